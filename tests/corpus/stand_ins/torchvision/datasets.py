"""``MNIST`` read from the synthetic files the corpus harness writes (Lightning's ``PL_USE_MOCKED_MNIST`` format).

Lightning's example programs read Lightning's own MNIST demo (``PL_USE_MOCKED_MNIST=1``); the programs assembled
from Lightning's documentation call ``torchvision.datasets.MNIST(root, train=..., download=..., transform=...)``.
This stand-in reads ``<root>/MNIST/complete/{training,test}.pt`` when present, else the copy the harness writes
under ``./data``; it never downloads. An image is a ``uint8`` tensor of shape ``(1, 28, 28)`` (torchvision gives
a PIL image; the stand-in ``ToTensor`` turns either into floats in ``[0, 1]``).
"""

import os

import numpy as np
import torch
from torch.utils.data import Dataset


class MNIST(Dataset):
    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        name = "training.pt" if train else "test.pt"
        candidates = [
            os.path.join(str(root), "MNIST", "complete", name),
            os.path.join("data", "MNIST", "complete", name),
        ]
        path = next((p for p in candidates if os.path.isfile(p)), None)
        if path is None:
            raise RuntimeError(
                f"the corpus stand-in found no MNIST file at {candidates}; run through run_program.py"
            )
        self.data, self.targets = torch.load(path)

    def __getitem__(self, index):
        img, target = self.data[index].unsqueeze(0), int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __len__(self):
        return len(self.data)


class CIFAR10(Dataset):
    """CIFAR-10's attributes with synthetic images: ``data`` a ``uint8`` array ``(N, 32, 32, 3)``, ``targets`` ints.

    Built in memory from a fixed seed (no file, no download, the global random generators untouched), with
    fewer samples than the real set (:attr:`TRAIN_SIZE`, :attr:`TEST_SIZE`). An image comes out as a ``uint8``
    tensor of shape ``(3, 32, 32)``, as torchvision's ``ToTensor`` would lay it out.
    """

    TRAIN_SIZE = 500
    TEST_SIZE = 100
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        rng = np.random.default_rng(10 if train else 11)
        size = self.TRAIN_SIZE if train else self.TEST_SIZE
        self.data = rng.integers(0, 256, (size, 32, 32, 3), dtype=np.uint8)
        self.targets = [int(t) for t in rng.integers(0, 10, size)]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __getitem__(self, index):
        img = torch.from_numpy(self.data[index]).permute(2, 0, 1).contiguous()
        target = self.targets[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __len__(self):
        return len(self.data)


class CIFAR100(CIFAR10):
    """CIFAR-100's attributes with synthetic images, as :class:`CIFAR10` builds them (100 classes, other seeds).

    Every class has the same number of images, as in the real set (programs reshape the sorted labels into
    ``[classes, images per class]``): 100 per class for training, 10 for testing.
    """

    TRAIN_SIZE = 10000
    TEST_SIZE = 1000
    classes = [f"class_{i}" for i in range(100)]

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        super().__init__(root, train, transform, target_transform, download)
        rng = np.random.default_rng(100 if train else 101)
        self.data = rng.integers(0, 256, self.data.shape, dtype=np.uint8)
        self.targets = [int(t) for t in rng.permutation(np.arange(len(self.data)) % 100)]


class CelebA(Dataset):
    """CelebA's interface with synthetic faces: ``uint8`` images ``(3, 218, 178)`` and 40 binary attributes.

    Built in memory from a fixed seed per split (no file, no download, the global random generators untouched),
    with fewer samples than the real set (:attr:`SIZES`); ``target_type="attr"`` only.
    """

    SIZES = {"train": 192, "valid": 160, "test": 160, "all": 192}

    def __init__(
        self, root, split="train", target_type="attr", transform=None, target_transform=None, download=False
    ):
        self.root, self.split, self.target_type = root, split, target_type
        self.transform, self.target_transform = transform, target_transform
        if not self._check_integrity():
            raise RuntimeError("Dataset not found or corrupted.")
        rng = np.random.default_rng(sorted(self.SIZES).index(split) + 20)
        size = self.SIZES[split]
        self.data = rng.integers(0, 256, (size, 3, 218, 178), dtype=np.uint8)
        self.attr = torch.from_numpy(rng.integers(0, 2, (size, 40))).long()

    def _check_integrity(self):
        return True

    def __getitem__(self, index):
        img = torch.from_numpy(self.data[index])
        target = self.attr[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __len__(self):
        return len(self.data)


class SVHN(Dataset):
    """SVHN's attributes with synthetic digits: ``data`` a ``uint8`` array ``(N, 3, 32, 32)``, ``labels`` ints 0-9.

    Built in memory from a fixed seed per split (no file, no download, the global random generators untouched),
    with fewer samples than the real set (:attr:`SIZES`).
    """

    SIZES = {"train": 500, "test": 1000, "extra": 500}

    def __init__(self, root, split="train", transform=None, target_transform=None, download=False):
        self.root, self.split = root, split
        self.transform, self.target_transform = transform, target_transform
        rng = np.random.default_rng(sorted(self.SIZES).index(split) + 30)
        size = self.SIZES[split]
        self.data = rng.integers(0, 256, (size, 3, 32, 32), dtype=np.uint8)
        self.labels = rng.permutation(np.arange(size) % 10).astype(np.int64)

    def __getitem__(self, index):
        img, target = torch.from_numpy(self.data[index]), int(self.labels[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __len__(self):
        return len(self.data)


def _folder_module():
    """``torchvision.datasets.folder`` (imported by programs that read image folders): ``default_loader`` only."""
    import sys
    import types

    def default_loader(path):
        raise RuntimeError(f"the corpus stand-in reads no image files ({path})")

    module = types.ModuleType(f"{__name__}.folder")
    module.default_loader = default_loader
    sys.modules[module.__name__] = module
    return module


folder = _folder_module()
