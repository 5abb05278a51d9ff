"""``ToTensor``, ``Normalize`` and ``Compose`` as the corpus programs use them."""

import torch


class ToTensor:
    def __call__(self, pic):
        if isinstance(pic, torch.Tensor):
            return pic.float().div(255) if pic.dtype == torch.uint8 else pic
        return torch.as_tensor(pic, dtype=torch.float32)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, tensor):
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / std


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x
