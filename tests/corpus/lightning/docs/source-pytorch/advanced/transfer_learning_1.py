# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/advanced/transfer_learning.rst
# at commit 7f0c3436cd3f6ad3753125672024fc415cbcb414, section "Finetuning with BaseFinetuning": the `MyModel` code
# block (a model with a `backbone` and a `head` whose optimizer holds only the head) and the `CustomFinetuning` code
# block, concatenated in order, every shown line unchanged. Completed (the blocks use them without showing them):
# the imports, `some_pretrained_model`, `backbone_features`, `num_classes`, the training step and data, and the
# Trainer that fits with the callback (unfreezing from epoch 1, so that it happens within the corpus' 2 epochs).
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer

# ---- completed: not shown in the docs ----
backbone_features, num_classes = 16, 3
some_pretrained_model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, backbone_features))
# ---- end of completion ----


class MyModel(LightningModule):
    def __init__(self):
        super().__init__()

        # REQUIRED: Your model must have a 'backbone' attribute
        # This should be the pretrained part you want to finetune
        self.backbone = some_pretrained_model

        # Your task-specific layers (head, classifier, etc.)
        self.head = nn.Linear(backbone_features, num_classes)

    def configure_optimizers(self):
        # Only optimize the head initially - backbone will be added automatically
        return torch.optim.Adam(self.head.parameters(), lr=1e-3)

    # ---- completed: not shown in the docs ----
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.backbone(x)), y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, num_classes, (64,), generator=g)), batch_size=8)
    # ---- end of completion ----

from lightning.pytorch.callbacks.finetuning import BaseFinetuning


class CustomFinetuning(BaseFinetuning):
    def __init__(self, unfreeze_at_epoch=5, layers_per_epoch=2):
        super().__init__()
        self.unfreeze_at_epoch = unfreeze_at_epoch
        self.layers_per_epoch = layers_per_epoch

    def freeze_before_training(self, pl_module):
        # Freeze the entire backbone initially
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch, optimizer):
        # Gradually unfreeze layers
        if epoch >= self.unfreeze_at_epoch:
            layers_to_unfreeze = min(
                self.layers_per_epoch,
                len(list(pl_module.backbone.children()))
            )

            # Unfreeze from the top layers down
            backbone_children = list(pl_module.backbone.children())
            for layer in backbone_children[-layers_to_unfreeze:]:
                self.unfreeze_and_add_param_group(
                    layer, optimizer, lr=1e-4
                )


# ---- completed: not shown in the docs ----
trainer = Trainer(callbacks=[CustomFinetuning(unfreeze_at_epoch=1)], max_epochs=2)
trainer.fit(MyModel())
