"""``MNIST`` read from the synthetic files the corpus harness writes (Lightning's ``PL_USE_MOCKED_MNIST`` format).

Lightning's example programs read Lightning's own MNIST demo (``PL_USE_MOCKED_MNIST=1``); the programs assembled
from Lightning's documentation call ``torchvision.datasets.MNIST(root, train=..., download=..., transform=...)``.
This stand-in reads ``<root>/MNIST/complete/{training,test}.pt`` when present, else the copy the harness writes
under ``./data``; it never downloads. An image is a ``uint8`` tensor of shape ``(1, 28, 28)`` (torchvision gives
a PIL image; the stand-in ``ToTensor`` turns either into floats in ``[0, 1]``).
"""

import os

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
