"""``EasyDict`` as the ``easydict`` package has it (not installed here): a dict whose keys are also attributes.

Nested dicts (also inside lists and tuples) become ``EasyDict`` too; the values themselves are kept as given.
"""


class EasyDict(dict):
    def __init__(self, d=None, **kwargs):
        super().__init__()
        for key, value in {**(d or {}), **kwargs}.items():
            setattr(self, key, value)

    def __setattr__(self, name, value):
        if isinstance(value, dict) and not isinstance(value, EasyDict):
            value = EasyDict(value)
        elif isinstance(value, (list, tuple)):
            value = type(value)(EasyDict(v) if isinstance(v, dict) else v for v in value)
        super().__setattr__(name, value)
        super().__setitem__(name, value)

    __setitem__ = __setattr__

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None
