"""``ToTensor``, ``Normalize``, ``Compose``, ``RandomCrop``, ``RandomHorizontalFlip`` and ``RandomResizedCrop`` as the corpus programs use them
(on ``(C, H, W)`` tensors; the random ones draw from torch's generator, as torchvision's do)."""

import math
import sys

import torch


def _pil_to_uint8(pic):
    """A PIL image as torchvision lays it out: a ``uint8`` ``(C, H, W)`` tensor (tensors pass through)."""
    if isinstance(pic, torch.Tensor) or not hasattr(pic, "getbands"):
        return pic
    import numpy as np

    array = np.array(pic, dtype=np.uint8)
    return torch.from_numpy(array.reshape(*array.shape[:2], -1)).permute(2, 0, 1).contiguous()


class ToTensor:
    def __call__(self, pic):
        pic = _pil_to_uint8(pic)
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


class RandomCrop:
    def __init__(self, size, padding=None):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.padding = padding

    def __call__(self, img):
        if self.padding:
            img = torch.nn.functional.pad(img, [self.padding] * 4)
        height, width = img.shape[-2:]
        top = int(torch.randint(0, height - self.size[0] + 1, size=(1,)))
        left = int(torch.randint(0, width - self.size[1] + 1, size=(1,)))
        return img[..., top : top + self.size[0], left : left + self.size[1]]


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, img):
        img = _pil_to_uint8(img)
        return img.flip(-1) if torch.rand(1) < self.p else img


class RandomResizedCrop:
    """A crop of random area (``scale``) and aspect ratio (``ratio``), resized bilinearly to ``size``."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0)):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.scale, self.ratio = scale, ratio

    def __call__(self, img):
        img = _pil_to_uint8(img)
        height, width = img.shape[-2:]
        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)))
                left = int(torch.randint(0, width - w + 1, size=(1,)))
                break
        else:
            h, w, top, left = height, width, 0, 0
        crop = img[..., top : top + h, left : left + w]
        resized = torch.nn.functional.interpolate(
            crop.unsqueeze(0).float(), size=self.size, mode="bilinear", align_corners=False
        )[0]
        if img.dtype == torch.uint8:
            return resized.round().clamp(0, 255).to(img.dtype)
        return resized.to(img.dtype)


class CenterCrop:
    def __init__(self, size):
        self.size = (size, size) if isinstance(size, int) else tuple(size)

    def __call__(self, img):
        height, width = img.shape[-2:]
        top = round((height - self.size[0]) / 2.0)
        left = round((width - self.size[1]) / 2.0)
        return img[..., top : top + self.size[0], left : left + self.size[1]]


class Resize:
    """Bilinear resize; an int ``size`` is the smaller edge's length, the aspect ratio kept (torchvision's rule)."""

    def __init__(self, size):
        self.size = size

    def __call__(self, img):
        height, width = img.shape[-2:]
        if isinstance(self.size, int):
            short, long = (height, width) if height <= width else (width, height)
            other = int(self.size * long / short)
            size = (self.size, other) if height <= width else (other, self.size)
        else:
            size = tuple(self.size)
        resized = torch.nn.functional.interpolate(
            img.unsqueeze(0).float(), size=size, mode="bilinear", align_corners=False, antialias=True
        )[0]
        if img.dtype == torch.uint8:
            return resized.round().clamp(0, 255).to(img.dtype)
        return resized.to(img.dtype)


# torchvision's transforms are a package whose `transforms` module holds these classes:
# `from torchvision.transforms import transforms` finds them here too.
transforms = sys.modules[__name__]
