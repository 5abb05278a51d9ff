# Source: https://github.com/rasbt/scipy2023-deeplearning, commit 6fbb8230f9f7f8255ed6655b1473157190b2e850, path 05_organizing-pytorch-code/extra/scheduler-example/scheduler-cosine.ipynb
# License: Apache License 2.0
# Changes (everything that differs from the original):
# - notebook: its code cells in order, `# %%` between cells; the IPython magics `%load_ext watermark` and `%watermark ...` commented out
# - smaller sizes: `num_epochs = 100` -> `num_epochs = 2` (the learning-rate schedule then spans the 2 epochs the corpus runs)
# - display-only lines commented out: the `plt.*`, `ax1.*`, `ax2.*` plotting and `plt.savefig`/`plt.show()` lines, `df_metrics[...].plot(...)` (the schedules' computation and the metrics.csv aggregation stay)
# %%
# %load_ext watermark
# %watermark -p torch,lightning

# %%
import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.loggers import CSVLogger

from shared_utilities import CustomDataModule, PyTorchMLP

# %%
num_epochs = 2

# %%
import matplotlib.pyplot as plt

model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_epochs/10)
lrs = []


for i in range(num_epochs):
    optimizer.step()
    lrs.append(optimizer.param_groups[0]["lr"])
    scheduler.step()

# plt.ylabel("Learning rate")
# plt.xlabel("Epoch")
# plt.plot(lrs)
#plt.savefig("cosine-restart.pdf")
# plt.show()

# %%
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_epochs)
lrs = []

for i in range(num_epochs):
    optimizer.step()
    lrs.append(optimizer.param_groups[0]["lr"])
    scheduler.step()

# plt.ylabel("Learning rate")
# plt.xlabel("Epoch")
# plt.plot(lrs)
#plt.savefig("cosine-1cycle-epoch.pdf")
# plt.show()

# %%
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


dm = CustomDataModule()
dm.setup("training")
num_steps = num_epochs * len(dm.train_dataloader())
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_steps)
lrs = []


for i in range(num_steps):
    optimizer.step()
    lrs.append(optimizer.param_groups[0]["lr"])
    scheduler.step()


# ax1 = plt.subplot(1, 1, 1)
# ax1.set_ylabel("Learning rate")
# ax1.set_xlabel("Iterations")
# ax1.plot(lrs)

###################
# Set second x-axis
# ax2 = ax1.twiny()
# newlabel = list(range(num_epochs+1))

# newpos = [e * (num_steps // num_epochs) for e in newlabel]

# ax2.set_xticks(newpos[::20])
# ax2.set_xticklabels(newlabel[::20])

# ax2.xaxis.set_ticks_position('bottom')
# ax2.xaxis.set_label_position('bottom')
# ax2.spines['bottom'].set_position(('outward', 45))
# ax2.set_xlabel('Epochs')
# ax2.set_xlim(ax1.get_xlim());

#plt.tight_layout()
#plt.savefig("cosine-1cycle-batch.pdf")
# plt.show()

# %%
class LightningModel(L.LightningModule):
    def __init__(self, model, learning_rate, cosine_t_max):  # New!
        super().__init__()

        self.learning_rate = learning_rate
        self.cosine_t_max = cosine_t_max  # New!
        self.model = model

        self.save_hyperparameters(ignore=["model"])

        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def forward(self, x):
        return self.model(x)

    def _shared_step(self, batch):
        features, true_labels = batch
        logits = self(features)

        loss = F.cross_entropy(logits, true_labels)
        predicted_labels = torch.argmax(logits, dim=1)
        return loss, true_labels, predicted_labels

    def training_step(self, batch, batch_idx):
        loss, true_labels, predicted_labels = self._shared_step(batch)

        self.log("train_loss", loss)
        self.train_acc(predicted_labels, true_labels)
        self.log(
            "train_acc", self.train_acc, prog_bar=True, on_epoch=True, on_step=False
        )
        return loss

    def validation_step(self, batch, batch_idx):
        loss, true_labels, predicted_labels = self._shared_step(batch)

        self.log("val_loss", loss, prog_bar=True)
        self.val_acc(predicted_labels, true_labels)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch, batch_idx):
        loss, true_labels, predicted_labels = self._shared_step(batch)
        self.test_acc(predicted_labels, true_labels)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.learning_rate)
        sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.cosine_t_max) # New!

        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": sch,
                "monitor": "train_loss",
                "interval": "step", # step means "batch" here, default: epoch   # New!
                "frequency": 1, # default
            },
        }

# %%
L.seed_everything(123)
dm = CustomDataModule()

pytorch_model = PyTorchMLP(num_features=100, num_classes=2)
lightning_model = LightningModel(model=pytorch_model, learning_rate=0.1,
                                 cosine_t_max=num_steps) # New!

trainer = L.Trainer(
    max_epochs=num_epochs,
    accelerator="cpu",
    devices="auto",
    logger=CSVLogger(save_dir="logs/", name="my-model"),
    deterministic=True,
)

# %%
trainer.fit(model=lightning_model, datamodule=dm)

# %%
### Plot
import matplotlib.pyplot as plt
import pandas as pd

metrics = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")

aggreg_metrics = []
agg_col = "epoch"
for i, dfg in metrics.groupby(agg_col):
    agg = dict(dfg.mean())
    agg[agg_col] = i
    aggreg_metrics.append(agg)

df_metrics = pd.DataFrame(aggreg_metrics)
# df_metrics[["train_loss", "val_loss"]].plot(
#     grid=True, legend=True, xlabel="Epoch", ylabel="Loss"
# )

# plt.savefig("suggest_loss.pdf")

# df_metrics[["train_acc", "val_acc"]].plot(
#     grid=True, legend=True, xlabel="Epoch", ylabel="ACC"
# )

# plt.savefig("suggest_acc.pdf")

# plt.show()

# %%
trainer.test(model=lightning_model, datamodule=dm)
