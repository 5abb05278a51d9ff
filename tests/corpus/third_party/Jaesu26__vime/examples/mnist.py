# Source: https://github.com/Jaesu26/vime, commit 6afbcfd3ec2b4b1f9ecab2727b6d1f681e207d50, path examples/mnist.ipynb
# License: MIT License (Copyright (c) 2023 Jaesu Han)
# Changes (everything that differs from the original):
# - the notebook's code cells in order, each `# %% cell N` giving its number; markdown cells left out
# - Colab-only cells commented out: 1 (`google.colab` drive mount), 2 (`%cd` into the Drive folder),
#   3 (`!pip install git+https://github.com/Jaesu26/vime.git`: the package's files are beside this folder)
# - synthetic data: cell 9's `fetch_openml("mnist_784")` (a download) commented out and replaced by a Bunch of the
#   same layout (`data` a DataFrame of float64 pixel values 0-255 with 784 columns, `target` a categorical Series of
#   the digit strings "0"-"9"), 7,000 rows instead of 70,000, from a fixed seed
# - GPU-only: cell 34's two `.cuda()` calls removed (the harness trains on the CPU)
# - `easydict` (not installed here) is the corpus stand-in's EasyDict
# - cell 48: `weights_only=False` added to `trainer.predict(vime_semi, ..., ckpt_path="best")`: VIMESemi's
#   hyper-parameters hold an `nn.CrossEntropyLoss()`, which torch >= 2.6 refuses to unpickle by default, so that
#   call fails under Lightning 2.6 itself without it (the notebook predates torch 2.6)
# - nothing else: the harness gives each Trainer the CPU and its epoch/batch limits, and lets `trainer.predict`
#   run every batch (its manifest budget) so that `accuracy_score(y_test, pred)` sees the whole test set

# %% cell 1
# from google.colab import drive

# drive.mount("/content/drive")

# %% cell 2
# %cd /content/drive/MyDrive/Colab Notebooks/vime

# %% cell 3
# !pip install git+https://github.com/Jaesu26/vime.git

# %% cell 4
import os
import random
import warnings

import easydict
import numpy as np
import torch
import torch.nn as nn

warnings.filterwarnings("ignore")

# %% cell 5
args_mlp = easydict.EasyDict({
    "weights_dirpath": "./mlp_weights",
    "num_classes": 10,
    "max_epochs": 100,
    "batch_size": 64,
    "train_size": 0.9,
    "lr": 1e-3,
    "log_interval": 5,
    "seed": 26,
})
args_self = easydict.EasyDict({
    "weights_dirpath": "./vimeself_weights",
    "max_epochs": 10,
    "batch_size": 512,
    "train_size": 0.9,
    "lr": 1e-2,
    "p_masking": 0.3,
    "alpha": 2.0,
    "log_interval": 5,
    "seed": 26,
})
args_semi = easydict.EasyDict({
    "weights_dirpath": "./vimesemi_weights",
    "num_classes": 10,
    "supervised_criterion": nn.CrossEntropyLoss(),
    "max_epochs": 100,
    "labeled_batch_size": 64,
    "unlabeled_batch_size": 512,
    "train_size": 0.9,
    "lr": 1e-3,
    "p_masking": 0.3,
    "K": 3,
    "beta": 1.0,
    "log_interval": 5,
    "seed": 26,
})

# %% cell 6
def create_folder(path: str) -> None:
    try:
        if not os.path.exists(path):
            os.makedirs(path)
    except OSError as error:
        print(error)

# %% cell 7
create_folder(args_mlp.weights_dirpath)
create_folder(args_self.weights_dirpath)
create_folder(args_semi.weights_dirpath)

# %% cell 8
import sklearn
from sklearn.datasets import fetch_openml
from sklearn.model_selection import train_test_split

# %% cell 9
# mnist = fetch_openml("mnist_784")
from sklearn.utils import Bunch
import pandas as pd
_synthetic = np.random.default_rng(784)
mnist = Bunch(
    data=pd.DataFrame(_synthetic.integers(0, 256, (7000, 784)).astype(np.float64)),
    target=pd.Series(_synthetic.permutation(np.arange(7000) % 10).astype(str), dtype="category"),
)

# %% cell 10
data = mnist.data.values
target = mnist.target.astype(int).values

# %% cell 11
data = data / 255.0

# %% cell 12
data.shape

# %% cell 13
num_labeled_data_used = 1000
unlabeled_data_rate = 0.9
seed = 26

# %% cell 14
X, X_test, y, y_test = train_test_split(data, target, test_size=1/7, random_state=seed, stratify=target)

# %% cell 15
X_labeled, X_unlabeled, y, _ = train_test_split(X, y, test_size=unlabeled_data_rate, random_state=seed, stratify=y)

# %% cell 16
X_labeled = X_labeled[:num_labeled_data_used]
y = y[:num_labeled_data_used]

# %% cell 17
import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from sklearn.metrics import accuracy_score
from vime.datamodules import LabeledDataModule
from vime.lightningmodules import MLPClassifier

# %% cell 18
dim = X_labeled.shape[1]

# %% cell 19
labeled_datamodule = LabeledDataModule(
    X_labeled, y, X_test,
    train_size=args_mlp.train_size,
    batch_size=args_mlp.batch_size,
    seed=args_mlp.seed,
)

# %% cell 20
mlp_classifier = MLPClassifier(
    input_dim=dim,
    hidden_dims=[256, 128, 64],
    num_classes=args_mlp.num_classes,
    lr=args_mlp.lr,
    log_interval=args_mlp.log_interval,
    seed=args_mlp.seed,
)

# %% cell 21
checkpoint = ModelCheckpoint(
    dirpath=args_mlp.weights_dirpath,
    filename="mlp",
    monitor="val_loss",
    mode="min",
    save_weights_only=True,
)
early_stop = EarlyStopping(
    monitor="val_loss",
    patience=20,
    mode="min",
)
trainer = pl.Trainer(
    accelerator="gpu",
    devices=1,
    logger=False,
    callbacks=[checkpoint, early_stop],
    max_epochs=args_mlp.max_epochs,
    num_sanity_val_steps=0,
    enable_progress_bar=False,
    enable_model_summary=False,
    deterministic=True,
)

# %% cell 22
trainer.fit(mlp_classifier, labeled_datamodule)

# %% cell 23
pred = trainer.predict(mlp_classifier, labeled_datamodule, ckpt_path="best")
pred = np.concatenate(pred).argmax(1)

# %% cell 24
accuracy_score(y_test, pred)

# %% cell 25
from vime import VIMESelf, VIMESelfDataModule, VIMESemi, VIMESemiDataModule

# %% cell 26
dim = X_unlabeled.shape[1]

# %% cell 27
self_datamodule = VIMESelfDataModule(
    X_unlabeled,
    train_size=args_self.train_size,
    batch_size=args_self.batch_size,
    seed=args_self.seed,
)

# %% cell 28
vime_self = VIMESelf(
    input_dim=dim,
    hidden_dims=[256, 128],
    lr=args_self.lr,
    p_masking=args_self.p_masking,
    alpha=args_self.alpha,
    log_interval=args_self.log_interval,
    seed=args_self.seed,
)

# %% cell 29
checkpoint = ModelCheckpoint(
    dirpath=args_self.weights_dirpath,
    filename="vime_self",
    monitor="val_loss",
    mode="min",
    save_weights_only=True,
)
early_stop = EarlyStopping(
    monitor="val_loss",
    patience=5,
    mode="min",
)
trainer = pl.Trainer(
    accelerator="gpu",
    devices=1,
    logger=False,
    callbacks=[checkpoint, early_stop],
    max_epochs=args_self.max_epochs,
    num_sanity_val_steps=0,
    enable_progress_bar=False,
    enable_model_summary=False,
    deterministic=True,
)

# %% cell 30
trainer.fit(vime_self, self_datamodule)

# %% cell 31
best_model_path = checkpoint.best_model_path

# %% cell 32
vime_self_best = VIMESelf.load_from_checkpoint(best_model_path)

# %% cell 33
pretrained_encoder = vime_self_best.encoder

# %% cell 34
with torch.no_grad():
    Z = pretrained_encoder(torch.tensor(X_labeled, dtype=torch.float32))
    Z_test = pretrained_encoder(torch.tensor(X_test, dtype=torch.float32))

# %% cell 35
Z = Z.cpu().numpy()
Z_test = Z_test.cpu().numpy()

# %% cell 36
labeled_datamodule_from_unsupervised = LabeledDataModule(Z, y, Z_test, train_size=args_mlp.train_size, batch_size=args_mlp.batch_size, seed=args_mlp.seed)

# %% cell 37
mlp_classifier = MLPClassifier(
    input_dim=128,
    hidden_dims=[128, 64],
    num_classes=args_mlp.num_classes,
    lr=args_mlp.lr,
    seed=args_mlp.seed,
)

# %% cell 38
checkpoint = ModelCheckpoint(
    dirpath=args_mlp.weights_dirpath,
    filename="mlp_from_unsupervised",
    monitor="val_loss",
    mode="min",
    save_weights_only=True,
)
early_stop = EarlyStopping(
    monitor="val_loss",
    patience=10,
    mode="min",
)
trainer = pl.Trainer(
    accelerator="gpu",
    devices=1,
    logger=False,
    callbacks=[checkpoint, early_stop],
    max_epochs=args_mlp.max_epochs,
    num_sanity_val_steps=0,
    enable_progress_bar=False,
    enable_model_summary=False,
    deterministic=True,
)

# %% cell 39
trainer.fit(mlp_classifier, labeled_datamodule_from_unsupervised)

# %% cell 40
pred = trainer.predict(mlp_classifier, labeled_datamodule_from_unsupervised, ckpt_path="best")
pred = np.concatenate(pred).argmax(1)

# %% cell 41
accuracy_score(y_test, pred)

# %% cell 42
dim = X_labeled.shape[1]

# %% cell 43
semi_datamodule = VIMESemiDataModule(
    X_unlabeled,
    X_labeled,
    y,
    X_test,
    train_size=args_semi.train_size,
    labeled_batch_size=args_semi.labeled_batch_size,
    unlabeled_batch_size=args_semi.unlabeled_batch_size,
    seed=args_semi.seed,
)

# %% cell 44
vime_semi = VIMESemi(
    pretrained_encoder=pretrained_encoder,
    hidden_dims=[256, 128, 64],
    num_classes=args_semi.num_classes,
    supervised_criterion=args_semi.supervised_criterion,
    lr=args_semi.lr,
    p_masking=args_semi.p_masking,
    K=args_semi.K,
    beta=args_semi.beta,
    log_interval=args_semi.log_interval,
    seed=args_semi.seed,
)

# %% cell 45
checkpoint = ModelCheckpoint(
    dirpath=args_semi.weights_dirpath,
    filename="vime_semi",
    monitor="val_loss",
    mode="min",
    save_weights_only=True,
)
early_stop = EarlyStopping(
    monitor="val_loss",
    patience=20,
    mode="min",
)

# %% cell 46
trainer = pl.Trainer(
    accelerator="gpu",
    devices=1,
    logger=False,
    callbacks=[checkpoint, early_stop],
    max_epochs=args_semi.max_epochs,
    num_sanity_val_steps=0,
    enable_progress_bar=False,
    enable_model_summary=False,
    deterministic=True,
)

# %% cell 47
trainer.fit(vime_semi, semi_datamodule)

# %% cell 48
pred = trainer.predict(vime_semi, semi_datamodule, ckpt_path="best", weights_only=False)
pred = np.concatenate(pred).argmax(1)

# %% cell 49
accuracy_score(y_test, pred)
