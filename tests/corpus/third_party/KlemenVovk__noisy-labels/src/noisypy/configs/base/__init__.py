# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/configs/base/__init__.py
# License: MIT
# Changes (everything that differs from the original):
# - none
