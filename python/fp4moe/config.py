"""Layer configurations: a preset name, a dict of fp4moe fields, or a checkpoint's config.json.

Hugging Face fields are mapped as follows (the first one present wins):

    hidden_size                                   -> hidden
    moe_intermediate_size, intermediate_size      -> intermediate (the routed experts' width)
    n_routed_experts, num_experts, num_local_experts -> num_experts
    num_experts_per_tok, experts_per_token        -> top_k
    n_shared_experts                              -> num_shared (0 when absent)
    scoring_func / topk_method / model_type       -> router: "sigmoid" or "noaux_tc" or a DeepSeek-V3 /
                                                     GLM-4.5+ / Kimi-K2 model type -> sigmoid_grouped;
                                                     gpt_oss -> gpt_oss; otherwise softmax
    n_group, topk_group                           -> n_group, topk_group (sigmoid_grouped; default 1)
    routed_scaling_factor                         -> routed_scaling (default 1.0)
    norm_topk_prob                                -> renormalize (default True; Mixtral always renormalizes)
    swiglu_limit (gpt_oss)                        -> swiglu_limit; alpha 1.702, expert biases
    quantization_config.quant_method == "mxfp4"   -> format "mxfp4" (from tensors: NVFP4 only, see MoeLayer)

A multimodal config whose MoE text model sits under "text_config" is read from there.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Union

from ._loader import ext as _ext

Config = _ext.Config
ConfigLike = Union[str, "os.PathLike[str]", Mapping, Config]

FIELDS = (
    "name",
    "hidden",
    "intermediate",
    "num_experts",
    "top_k",
    "num_shared",
    "router",
    "renormalize",
    "n_group",
    "topk_group",
    "routed_scaling",
    "activation",
    "swiglu_alpha",
    "swiglu_limit",
    "expert_bias",
    "format",
)
_REQUIRED = ("hidden", "intermediate", "num_experts", "top_k")
# Model types whose router is sigmoid + correction bias with grouped top-k ("noaux_tc").
_SIGMOID_MODEL_TYPES = {"deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe", "glm_moe_dsa", "glm4v_moe", "kimi_k25"}
_HF_MARKERS = ("hidden_size", "model_type", "architectures", "text_config")


def preset(name: str) -> Config:
    """A copy of a model preset: one of preset_names()."""
    return _ext.preset(name)


def preset_names() -> list[str]:
    return list(_ext.preset_names())


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config's fields as a dict (make_config(to_dict(c)) gives c back)."""
    return {f: getattr(cfg, f) for f in FIELDS}


def _copy(cfg: Config) -> Config:
    c = Config()
    for f in FIELDS:
        setattr(c, f, getattr(cfg, f))
    return c


_STR_FIELDS = ("name", "router", "activation", "format")
_BOOL_FIELDS = ("renormalize", "expert_bias")
_FLOAT_FIELDS = ("routed_scaling", "swiglu_alpha", "swiglu_limit")


def _check_type(k: str, v: Any, where: str) -> None:
    if k in _STR_FIELDS:
        ok = isinstance(v, str)
    elif k in _BOOL_FIELDS:
        ok = isinstance(v, bool)
    elif k in _FLOAT_FIELDS:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    else:
        ok = isinstance(v, int) and not isinstance(v, bool)
    if not ok:
        raise TypeError(f"{where}: field '{k}' = {v!r} is a {type(v).__name__}")


def _set_fields(cfg: Config, fields: Mapping, where: str) -> Config:
    for k, v in fields.items():
        if k not in FIELDS:
            raise ValueError(f"{where}: unknown field '{k}'; fp4moe config fields are: {', '.join(FIELDS)}")
        _check_type(k, v, where)
        try:
            setattr(cfg, k, v)
        except TypeError as e:
            raise TypeError(f"{where}: field '{k}' = {v!r}: {e}") from None
    return cfg


def _read_json(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def make_config(config: ConfigLike) -> Config:
    """A validated Config from
    - a preset name ("glm-5", see preset_names()),
    - a path to a checkpoint's config.json (or to the checkpoint directory),
    - a dict: a Hugging Face config (has hidden_size / model_type / architectures), or fp4moe fields
      (see FIELDS; hidden, intermediate, num_experts, top_k required), or {"preset": name, **overrides},
    - a Config (copied).
    Raises ValueError / TypeError naming the field, or fp4moe.Error with the rule the config breaks.
    """
    if isinstance(config, Config):
        cfg = _copy(config)
    elif isinstance(config, (str, os.PathLike)):
        s = os.fspath(config)
        if s in _ext.preset_names():
            cfg = preset(s)
        elif os.path.exists(s):
            cfg = config_from_hf(_read_json(s))
        else:
            raise ValueError(
                f"config: '{s}' is neither a preset ({', '.join(_ext.preset_names())}) nor an existing "
                "config.json file or checkpoint directory")
    elif isinstance(config, Mapping):
        if "preset" in config:
            rest = {k: v for k, v in config.items() if k != "preset"}
            cfg = _set_fields(preset(config["preset"]), rest, "config")
        elif any(k in config for k in _HF_MARKERS):
            cfg = config_from_hf(config)
        else:
            missing = [k for k in _REQUIRED if k not in config]
            if missing:
                raise ValueError(
                    f"config: missing field(s) {', '.join(missing)}; give fp4moe fields ({', '.join(FIELDS)}), "
                    "a Hugging Face config.json dict, or {'preset': name, ...}")
            cfg = _set_fields(Config(), config, "config")
            if not cfg.name:
                cfg.name = "custom"
    else:
        raise TypeError(
            f"config: a {type(config).__name__}; pass a preset name, a config.json path, a dict or an fp4moe.Config")
    cfg.validate()
    return cfg


def _first(d: Mapping, keys: tuple[str, ...], what: str, required: bool = True) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    if required:
        raise ValueError(f"config.json: no {what} (looked for {', '.join(keys)})")
    return None


def config_from_hf(hf: Mapping, name: str | None = None) -> Config:
    """Maps a Hugging Face config.json (as a dict) onto an fp4moe Config (see the module docstring)."""
    d: Mapping = hf
    if "hidden_size" not in d and isinstance(d.get("text_config"), Mapping):
        d = d["text_config"]
    model_type = str(d.get("model_type") or hf.get("model_type") or "").lower()
    archs = d.get("architectures") or hf.get("architectures") or []
    c = Config()
    c.name = name or model_type or (archs[0] if archs else "hf-config")
    c.hidden = int(_first(d, ("hidden_size",), "hidden size"))
    c.intermediate = int(_first(d, ("moe_intermediate_size", "intermediate_size"), "expert width"))
    c.num_experts = int(_first(d, ("n_routed_experts", "num_experts", "num_local_experts"), "routed expert count"))
    c.top_k = int(_first(d, ("num_experts_per_tok", "experts_per_token", "num_experts_per_token"), "top-k"))
    c.num_shared = int(d.get("n_shared_experts") or 0)
    if d.get("shared_expert_intermediate_size"):
        raise ValueError(
            "config.json: shared_expert_intermediate_size is set: a sigmoid-gated shared expert (Qwen2-MoE style) "
            "is not supported by fp4moe's layer; run that expert outside it")
    scoring = str(d.get("scoring_func") or "").lower()
    topk_method = str(d.get("topk_method") or "").lower()
    is_gpt_oss = model_type == "gpt_oss" or any("GptOss" in a for a in archs)
    if scoring not in ("", "softmax", "sigmoid"):
        raise ValueError(f"config.json: scoring_func = '{scoring}' is not supported (softmax or sigmoid)")
    if is_gpt_oss:
        c.router = "gpt_oss"
        c.activation = "gpt_oss_swiglu"
        c.expert_bias = True
        c.renormalize = False
        c.swiglu_alpha = 1.702
        c.swiglu_limit = float(d.get("swiglu_limit") or 7.0)
    elif scoring == "sigmoid" or topk_method == "noaux_tc" or (not scoring and model_type in _SIGMOID_MODEL_TYPES):
        c.router = "sigmoid_grouped"
        c.n_group = int(d.get("n_group") or 1)
        c.topk_group = int(d.get("topk_group") or 1)
        c.renormalize = bool(d.get("norm_topk_prob", True))
        c.routed_scaling = float(d.get("routed_scaling_factor") or 1.0)
    else:
        c.router = "softmax"
        n_group = int(d.get("n_group") or 1)
        if n_group > 1 and topk_method not in ("", "greedy"):
            raise ValueError(
                f"config.json: softmax routing with group-limited top-k (topk_method = '{topk_method}', "
                f"n_group = {n_group}) is not supported; fp4moe groups experts only for the sigmoid router")
        c.renormalize = True if model_type == "mixtral" else bool(d.get("norm_topk_prob", True))
        c.routed_scaling = float(d.get("routed_scaling_factor") or 1.0)
    act = str(d.get("hidden_act") or "silu").lower()
    if not is_gpt_oss and act not in ("silu", "swiglu", "swish"):
        raise ValueError(f"config.json: hidden_act = '{act}'; fp4moe's experts compute SwiGLU (silu)")
    quant = d.get("quantization_config") or hf.get("quantization_config") or {}
    if isinstance(quant, Mapping) and str(quant.get("quant_method", "")).lower() == "mxfp4":
        c.format = "mxfp4"
    return c
