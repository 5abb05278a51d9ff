"""Hyper-parameters of a module or a data module: ``save_hyperparameters`` and reading them back.

Shared by ``LightningModule``, ``LightningDataModule`` and the checkpoint code (which rebuilds a
module from its checkpoint's hyper-parameters), so it sits below all three and imports none of them.
"""

from __future__ import annotations

import copy
import enum
import functools
import inspect
import os
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
from torch import nn

from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import AttributeDict

#: The YAML tag of a class or function named in an ``hparams.yaml`` (PyYAML's, as Lightning writes it).
_PYTHON_NAME = "tag:yaml.org,2002:python/name:"
#: The largest ``hparams_file`` read: loggers write a few KiB, and a pure-Python YAML parse of much more
#: takes seconds; a file this big is not a file of hyper-parameters.
MAX_HPARAMS_FILE_BYTES = 2**20


def _load_hparams_file(hparams_file: Any) -> dict[str, Any]:
    """The hyper-parameters in ``load_from_checkpoint(hparams_file=...)``: a YAML mapping or a ``.csv``.

    Every way the file can be wrong (too big, not UTF-8 text, not YAML or CSV, not a mapping of names,
    nested too deep or a "billion laughs" of YAML aliases) is one :class:`MisconfigurationException`
    naming it; a missing file is a ``FileNotFoundError``.
    """
    from trainer_core import paths
    from trainer_core.utilities.nesting import nesting_problem

    path = os.fspath(hparams_file)
    where = f"load_from_checkpoint(hparams_file={path!r})"
    extension = path.rsplit(".", 1)[-1].lower()
    if extension not in ("yaml", "yml", "csv"):
        raise MisconfigurationException(f"{where}: use a .yaml, .yml or .csv file of hyper-parameters.")
    fs, fs_path = paths.resolve(path)
    if not fs.exists(fs_path):
        raise FileNotFoundError(f"{where}: there is no such file.")
    if fs.isdir(fs_path):
        raise MisconfigurationException(f"{where} is a folder; pass the hparams.yaml file in it.")
    with fs.open(fs_path, "rb") as f:
        data = f.read(MAX_HPARAMS_FILE_BYTES + 1)
    if len(data) > MAX_HPARAMS_FILE_BYTES:
        raise MisconfigurationException(
            f"{where} is larger than {MAX_HPARAMS_FILE_BYTES // 2**20} MiB, which no file of hyper-parameters "
            "is; pass the hparams.yaml the logger wrote, or the hyper-parameters as keywords."
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise MisconfigurationException(
            f"{where} is not UTF-8 text (byte {err.start} is {data[err.start : err.start + 1]!r}); pass the "
            "hparams.yaml the logger wrote, or the hyper-parameters as keywords."
        ) from None
    hparams = _parse_csv(text, where) if extension == "csv" else _parse_yaml(text, where)
    if not isinstance(hparams, dict):
        raise MisconfigurationException(
            f"{where} holds a {type(hparams).__name__}; it must map hyper-parameter names to values."
        )
    not_names = [key for key in hparams if not isinstance(key, str)]
    if not_names:
        raise MisconfigurationException(
            f"{where} maps {not_names[0]!r} ({type(not_names[0]).__name__}) to a value; hyper-parameter names "
            "are strings."
        )
    problem = nesting_problem(hparams)
    if problem is not None:
        raise MisconfigurationException(f"{where} {problem}; pass a file of plain hyper-parameters.")
    return hparams


def _parse_csv(text: str, where: str) -> dict[str, Any]:
    """Lightning's layout: a ``key,value`` header, then one row per hyper-parameter."""
    import csv
    import io

    hparams: dict[str, Any] = {}
    try:
        for row in list(csv.reader(io.StringIO(text)))[1:]:
            if not row:
                continue
            if len(row) != 2:
                raise MisconfigurationException(
                    f"{where}: the row {row[:3]!r} has {len(row)} cells; each row is `name,value`."
                )
            hparams[row[0]] = _literal(row[1], row[0], where)
    except csv.Error as err:
        raise MisconfigurationException(f"{where} is not a CSV file of `name,value` rows: {err}.") from None
    return hparams


def hparams_to_yaml(hparams: Mapping[str, Any]) -> str:
    """``hparams`` as the YAML document Lightning's loggers write in ``hparams.yaml``, nesting kept.

    Lightning's ``yaml.dump``: block style, keys sorted, tuples tagged ``!!python/tuple``, a class or
    function as a ``!!python/name`` tag, an ``Enum`` by its name, so tools and :func:`_load_hparams_file`
    read back what was saved. Two deliberate
    differences: a value YAML cannot hold plainly (a ``functools.partial``, a tensor) is written as its
    ``repr``, where Lightning writes a ``!!python/object`` tag that no safe reader (nor Lightning's own
    ``full_load``) builds; and without PyYAML the document is JSON, which is YAML too.
    """
    try:
        import yaml
    except ImportError:
        import json

        return json.dumps(dict(hparams), indent=2, sort_keys=True, default=repr)
    return yaml.dump(dict(hparams), Dumper=_hparams_dumper(), default_flow_style=False, sort_keys=True)


@functools.cache
def _hparams_dumper() -> type:
    import yaml

    class HparamsDumper(yaml.SafeDumper):
        """PyYAML's safe dumper with Lightning's tuples, names and enums, and any other object as its ``repr``."""

    HparamsDumper.add_representer(tuple, _represent_tuple)
    # Every value whose exact type the safe dumper does not know (subclasses included) goes here.
    HparamsDumper.add_multi_representer(object, _represent_other)
    return HparamsDumper


def _represent_tuple(dumper: Any, value: tuple) -> Any:
    return dumper.represent_sequence("tag:yaml.org,2002:python/tuple", value)


def _represent_other(dumper: Any, value: Any) -> Any:
    """An ``Enum`` by its name (Lightning's rule), a subclass of a plain type as that type, else the ``repr``."""
    if isinstance(value, enum.Enum):
        return dumper.represent_str(value.name)
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        # A class or function by its name (``decoder_class=Decoder``), as Lightning's dumper names it.
        return dumper.represent_scalar(f"{_PYTHON_NAME}{value.__module__}.{value.__name__}", "")
    if isinstance(value, tuple):
        return _represent_tuple(dumper, value)
    if isinstance(value, np.generic):  # numpy's scalars, as the Python number they hold
        return dumper.represent_data(value.item())
    for plain in (dict, list, bool, int, float, str):
        if isinstance(value, plain):
            return dumper.represent_data(plain(value))
    return dumper.represent_str(repr(value))


@functools.cache
def _hparams_loader() -> type:
    import yaml

    class HparamsLoader(yaml.SafeLoader):
        """PyYAML's safe loader that also reads Lightning's ``!!python/tuple`` and ``!!python/name`` tags."""

    HparamsLoader.add_constructor(
        "tag:yaml.org,2002:python/tuple", lambda loader, node: tuple(loader.construct_sequence(node))
    )
    HparamsLoader.add_multi_constructor(_PYTHON_NAME, _imported_name)
    return HparamsLoader


def _imported_name(loader: Any, name: str, node: Any) -> Any:
    """A ``!!python/name:module.attr`` tag as the object, only from a module imported already (PyYAML's
    ``full_load`` rule, which Lightning reads with): reading the file imports nothing, so runs no code."""
    import yaml

    module_name, _, attribute = name.rpartition(".")
    module = sys.modules.get(module_name)
    if module is None or not hasattr(module, attribute):
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"{name!r} names nothing an imported module holds; import its module first",
            node.start_mark,
        )
    return getattr(module, attribute)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError:
        # CSVLogger and TensorBoardLogger write hparams.yaml as JSON (valid YAML): those need no YAML library.
        import json

        try:
            return json.loads(text)
        except RecursionError:
            raise _too_deep(where) from None
        except ValueError:
            raise MisconfigurationException(
                f"{where} needs PyYAML to read YAML: `pip install pyyaml`, "
                "or pass the hyper-parameters to load_from_checkpoint as keywords."
            ) from None
    try:
        # A safe loader: a hyper-parameter file must not be able to build arbitrary Python objects.
        return yaml.load(text, Loader=_hparams_loader())
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise _too_deep(where) from None
    except yaml.YAMLError as err:
        raise MisconfigurationException(f"{where} is not YAML that safe_load reads: {err}") from err


def _too_deep(where: str, key: Optional[str] = None) -> MisconfigurationException:
    what = f"the value of {key!r}" if key is not None else "it"
    return MisconfigurationException(
        f"{where}: {what} nests too deeply to be a hyper-parameter; pass a file of plain hyper-parameters."
    )


def _literal(text: str, key: str, where: str) -> Any:
    """A ``.csv`` cell as the Python value it spells (``0.1``, ``True``, ``[1, 2]``), else the text itself."""
    import ast

    try:
        return ast.literal_eval(text)
    except (RecursionError, MemoryError):  # what Python's parser raises on a literal nested very deep
        raise _too_deep(where, key) from None
    except SyntaxError as err:
        if "too many nested" in str(err):
            raise _too_deep(where, key) from None
        return text
    except (ValueError, TypeError):
        return text


def select_hyperparameters(
    owner: object,
    args: Sequence[Any],
    ignore: Optional[Union[Sequence[str], str]],
    frame: Any,
    owner_type: type,
) -> dict[str, Any]:
    """What ``owner.save_hyperparameters(*args, ignore=...)`` keeps (a module's or a data module's).

    With no ``args`` every argument of the ``__init__`` frames from ``frame`` outward; with names,
    only those (a name that is not an argument is an error: it would be silently missing on load);
    with one dict or ``argparse.Namespace``, that object's items.
    """
    if len(args) == 1 and not isinstance(args[0], str):
        source = args[0]
        hparams = (
            dict(vars(source))
            if hasattr(source, "__dict__") and not isinstance(source, Mapping)
            else dict(source)
        )
    else:
        init_args = _collect_init_args(frame, owner_type)
        if args:
            missing = [name for name in args if name not in init_args]
            if missing:
                raise ValueError(
                    f"save_hyperparameters: {missing} are not arguments of {type(owner).__name__}.__init__."
                )
            hparams = {name: init_args[name] for name in args}
        else:
            hparams = init_args
    for name in [ignore] if isinstance(ignore, str) else list(ignore or []):
        hparams.pop(name, None)
    return hparams


def store_hyperparameters(
    owner: Any,
    args: Sequence[Any],
    ignore: Optional[Union[Sequence[str], str]],
    frame: Any,
    owner_type: type,
) -> None:
    """``owner.save_hyperparameters(...)`` for a module or a data module, with Lightning's rules.

    What is selected is added to ``owner.hparams`` (a later call extends an earlier one); names in
    ``ignore`` are also removed from what was stored before, so a subclass can drop its parent's.
    ``hparams_initial`` becomes a deep copy, so later edits of ``hparams`` do not change it.
    """
    if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
        return  # an empty dict or Namespace: nothing to store (Lightning's rule)
    selected = select_hyperparameters(owner, args, ignore, frame, owner_type)
    owner._hparams_name = _hparams_name(args, frame, owner_type)
    stored = owner.hparams
    stored.update(selected)
    for name in [ignore] if isinstance(ignore, str) else list(ignore or []):
        stored.pop(name, None)
    modules = [name for name, value in stored.items() if isinstance(value, nn.Module)]
    if modules:
        from trainer_core.utilities import rank_zero_warn

        rank_zero_warn(
            f"save_hyperparameters: {modules} are nn.Module objects, which the checkpoint keeps as weights already "
            f"and not as hyper-parameters; leave them out with `self.save_hyperparameters(ignore={modules})`."
        )
    try:
        owner._hparams_initial = copy.deepcopy(stored)
    except Exception:  # an object that cannot be copied (a lock, a generator): share it instead
        owner._hparams_initial = AttributeDict(stored)


def _hparams_name(args: Sequence[Any], frame: Any, owner_type: type) -> Optional[str]:
    """The ``__init__`` argument that held the one dict given to ``save_hyperparameters`` (Lightning's ``hparams_name``).

    Loading passes the stored hyper-parameters back under that name (``cls(hparams={...})``)
    instead of spreading them, so ``__init__(self, hparams)`` modules load from their checkpoints.
    """
    if not (len(args) == 1 and not isinstance(args[0], str)):
        return None
    for name, value in _collect_init_args(frame, owner_type).items():
        if value is args[0]:
            return name
    return None


def hparams_argument(cls: type, name: Optional[str]) -> Optional[str]:
    """``name`` if it is a named ``__init__`` argument of ``cls`` (where a checkpoint's ``hparams_name`` goes), else ``None``.

    Lightning writes ``"kwargs"`` when ``save_hyperparameters()`` took every argument: that names
    no single argument, so ``*args``/``**kwargs`` never count.
    """
    if not name:
        return None
    parameter = inspect.signature(cls.__init__).parameters.get(name)
    named = parameter is not None and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    return name if named and name != "self" else None


def _collect_init_args(frame: Any, owner_type: type = nn.Module) -> dict[str, Any]:
    """The named arguments (and ``**kwargs``) of the ``__init__`` frames from ``frame`` outward.

    Walking outward collects a subclass's and its parents' init arguments, as Lightning does;
    the innermost frame wins on a name both define.
    """
    collected: dict[str, Any] = {}
    while frame is not None and frame.f_code.co_name == "__init__":
        info = inspect.getargvalues(frame)
        local_vars = info.locals
        if "self" not in local_vars or not isinstance(local_vars["self"], owner_type):
            break
        found: dict[str, Any] = {
            name: local_vars[name] for name in info.args if name != "self" and name in local_vars
        }
        if info.keywords and isinstance(local_vars.get(info.keywords), dict):
            found.update(local_vars[info.keywords])
        for key, value in found.items():
            collected.setdefault(key, value)
        frame = frame.f_back
    return collected
