# Source: https://github.com/ashleve/lightning-hydra-template, commit bddbc24b82ab6ccfa6243e815a49dc5bfe8d4144, path
#   src/train.py, FOLLOWED, NOT COPIED: this file is OURS (trainer-core's corpus), a stand-in for the template's
#   src/train.py without Hydra, OmegaConf, rootutils or src/utils (none is installed here).
# License: MIT License (Copyright (c) 2021 ashleve) for the flow it follows
# Changes (everything that differs from the original): all of it is ours. What it does, as
#   `python src/train.py experiment=example logger=csv` would (`logger=tensorboard` as an argument picks
#   configs/logger/tensorboard.yaml instead):
# - composes the config from the template's own YAML files (configs/), in train.yaml's defaults order, with the
#   experiment's and the logger's overrides merged on top, and `${paths.*}` resolved with root_dir "." (as
#   configs/paths/default.yaml suggests) and a fixed output_dir instead of Hydra's timestamped one;
# - instantiates every `_target_` as hydra.utils.instantiate does (recursively, `_partial_` -> functools.partial);
#   `lightning.pytorch.*` targets resolve in the framework the harness runs (its import below is rewritten);
# - runs train(cfg) as src/train.py does: seed_everything(seed, workers=True), data module, model, the callbacks and
#   loggers that have a `_target_` (instantiate_callbacks/_loggers), Trainer, log_hyperparameters (the same keys),
#   fit, then test on the best checkpoint.
# Differences from the template's run: config values are plain dicts and lists (Hydra passes DictConfig/ListConfig);
# trainer.test gets weights_only=False (the model's hyper-parameters hold an nn.Module and functools.partial
# objects, which torch>=2.6 refuses to unpickle by default; Lightning 2.6 needs the same argument).

import copy
import functools
import importlib
import re
import sys
from pathlib import Path

import lightning.pytorch as framework
import yaml

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
OUTPUT_DIR = "logs/train/runs/corpus"
PATHS = {
    "root_dir": ".",
    "data_dir": "./data/",
    "log_dir": "./logs/",
    "output_dir": OUTPUT_DIR,
    "work_dir": ".",
}


def load(name):
    return yaml.safe_load((CONFIGS / name).read_text()) or {}


def merge(base, override):
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def compose(logger="csv"):
    """train.yaml's defaults (data, model, callbacks, trainer, extras), then experiment=example, then logger=..."""
    cfg = {k: v for k, v in load("train.yaml").items() if k != "defaults"}
    cfg["data"] = load("data/mnist.yaml")
    cfg["model"] = load("model/mnist.yaml")
    callbacks = {}
    for name in ("model_checkpoint", "early_stopping", "model_summary", "rich_progress_bar"):
        merge(callbacks, load(f"callbacks/{name}.yaml"))
    cfg["callbacks"] = merge(
        callbacks, {k: v for k, v in load("callbacks/default.yaml").items() if k != "defaults"}
    )
    cfg["trainer"] = load("trainer/default.yaml")
    cfg["extras"] = load("extras/default.yaml")
    experiment = {k: v for k, v in load("experiment/example.yaml").items() if k != "defaults"}
    experiment["logger"] = merge(load(f"logger/{logger}.yaml"), experiment.get("logger") or {})
    cfg["logger"] = {}
    return merge(cfg, experiment)


def resolve(node, cfg):
    """`${paths.x}` and `${tags}` interpolations, as OmegaConf resolves them when a value is read."""
    if isinstance(node, dict):
        return {k: resolve(v, cfg) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, cfg) for v in node]
    if isinstance(node, str):
        whole = re.fullmatch(r"\$\{(\w+)\}", node)
        if whole:
            return cfg[whole.group(1)]
        return re.sub(r"\$\{paths\.(\w+)\}", lambda m: PATHS[m.group(1)], node)
    return node


def locate(target):
    parts = target.split(".")
    if parts[:2] == ["lightning", "pytorch"]:
        package, name = parts[2], parts[-1]
        for module in (f"{framework.__name__}.{package}", framework.__name__):
            found = getattr(importlib.import_module(module), name, None)
            if found is not None:
                return found
        raise ImportError(target)
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def instantiate(node, **kwargs):
    if isinstance(node, list):
        return [instantiate(v) for v in node]
    if not isinstance(node, dict):
        return node
    if "_target_" not in node:
        return {k: instantiate(v) for k, v in node.items()}
    args = {k: instantiate(v) for k, v in node.items() if k not in ("_target_", "_partial_")}
    args.update(kwargs)
    target = locate(node["_target_"])
    return functools.partial(target, **args) if node.get("_partial_") else target(**args)


def log_hyperparameters(object_dict):
    """src/utils/logging_utils.py's keys (the config parts as written, interpolations unresolved)."""
    cfg, model, trainer = object_dict["cfg"], object_dict["model"], object_dict["trainer"]
    if not trainer.logger:
        return
    hparams = {"model": cfg["model"]}
    hparams["model/params/total"] = sum(p.numel() for p in model.parameters())
    hparams["model/params/trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hparams["model/params/non_trainable"] = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    hparams["data"] = cfg["data"]
    hparams["trainer"] = cfg["trainer"]
    hparams["callbacks"] = cfg.get("callbacks")
    hparams["extras"] = cfg.get("extras")
    hparams["task_name"] = cfg.get("task_name")
    hparams["tags"] = cfg.get("tags")
    hparams["ckpt_path"] = cfg.get("ckpt_path")
    hparams["seed"] = cfg.get("seed")
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)


def train(raw_cfg):
    cfg = resolve(raw_cfg, raw_cfg)
    if cfg.get("seed"):
        framework.seed_everything(cfg["seed"], workers=True)
    datamodule = instantiate(cfg["data"])
    model = instantiate(cfg["model"])
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if "_target_" in c]
    logger = [instantiate(c) for c in (cfg.get("logger") or {}).values() if "_target_" in c]
    trainer = instantiate(cfg["trainer"], callbacks=callbacks, logger=logger)
    object_dict = {"cfg": raw_cfg, "datamodule": datamodule, "model": model, "trainer": trainer}
    if logger:
        log_hyperparameters(object_dict)
    if cfg.get("train"):
        trainer.fit(model=model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    train_metrics = trainer.callback_metrics
    if cfg.get("test"):
        ckpt_path = trainer.checkpoint_callback.best_model_path
        if ckpt_path == "":
            ckpt_path = None
        trainer.test(model=model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=False)
    test_metrics = trainer.callback_metrics
    return {**train_metrics, **test_metrics}, object_dict


if __name__ == "__main__":
    overrides = dict(arg.split("=", 1) for arg in sys.argv[1:])
    metric_dict, _ = train(compose(**overrides))
    print({k: float(v) for k, v in metric_dict.items()})
