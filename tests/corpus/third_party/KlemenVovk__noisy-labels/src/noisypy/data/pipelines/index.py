# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/data/pipelines/index.py
# License: MIT
# Changes (everything that differs from the original):
# - none
from typing import Type
from ..datasets.base import DatasetFW
from .base import AugmentationPipeline


class AddIndex(AugmentationPipeline):
    def transform(self, dataset_cls: Type[DatasetFW]) -> Type[DatasetFW]:
        class DatasetWithIndex(dataset_cls):
            def __getitem__(self, index):
                (x, y, *other) = super().__getitem__(index)
                return x, y, index, *other

        return DatasetWithIndex
