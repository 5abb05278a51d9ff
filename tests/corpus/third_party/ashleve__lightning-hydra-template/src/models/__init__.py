# Source: https://github.com/ashleve/lightning-hydra-template, commit bddbc24b82ab6ccfa6243e815a49dc5bfe8d4144, path src/models/__init__.py
# License: MIT License (Copyright (c) 2021 ashleve)
# Changes (everything that differs from the original):
# - none
