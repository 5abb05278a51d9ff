# Source: https://github.com/AntixK/PyTorch-VAE, commit a6896b944c918dd7030e7d795a8c13e5c6345ec7, path utils.py
# License: Apache License 2.0
# Changes (everything that differs from the original):
# - none
import pytorch_lightning as pl


## Utils to handle newer PyTorch Lightning changes from version 0.6
## ==================================================================================================== ##


def data_loader(fn):
    """
    Decorator to handle the deprecation of data_loader from 0.7
    :param fn: User defined data loader function
    :return: A wrapper for the data_loader function
    """

    def func_wrapper(self):
        try: # Works for version 0.6.0
            return pl.data_loader(fn)(self)

        except: # Works for version > 0.6.0
            return fn(self)

    return func_wrapper
