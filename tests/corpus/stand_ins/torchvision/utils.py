"""``make_grid`` (images side by side) and ``save_image`` (the tensor, written with torch.save)."""

import torch


def make_grid(tensor, nrow=8, padding=2, normalize=False, value_range=None, scale_each=False, pad_value=0.0):
    if tensor.dim() == 3:
        tensor = tensor.unsqueeze(0)
    if normalize:
        low, high = value_range if value_range is not None else (float(tensor.min()), float(tensor.max()))
        tensor = (tensor.clamp(low, high) - low) / max(high - low, 1e-5)
    return torch.cat(list(tensor), dim=-1)


def save_image(tensor, fp, **kwargs):
    torch.save(tensor.detach().cpu(), fp)
