# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/methods/classifiers/base.py
# License: MIT
# Changes (everything that differs from the original):
# - none
from typing import Any, Protocol

# A callable that takes num classes as input argument so we can autofill it during config building


class Classifier(Protocol):
    def __call__(self, num_classes: int, *args: Any, **kwds: Any) -> Any:
        return super().__call__(*args, **kwds)
