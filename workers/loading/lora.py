"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

An adapter is read once from disk into host memory, already laid out as the engine applies
it: per decoder layer and per fused linear the model runs (q/k/v as one `qkv` matmul,
gate/up as one `gate_up`), the A matrices of its targeted parts stacked by rows
([r_total, in]) and the B matrices as one block-diagonal [r_total, out] with the scale
(alpha / r, or alpha / sqrt(r) with rsLoRA) folded in. The LoRA delta of a linear is then
two matmuls, `(x @ A.T) @ B`, over only the adapter's own rank.

Everything is checked here, before anything is kept: the files, PEFT's settings kvserve
cannot honour (DoRA, biases, modules_to_save, fan-in-fan-out), the target modules (q, k, v,
o, gate, up, down, and Phi-3's fused qkv / gate_up), every rank against `max_rank`, and
every shape against the base model. Each failure is an AdapterError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from kvserve.errors import AdapterError
from kvserve.workers.loading.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# the fused linears of a decoder layer LoRA applies to, and the PEFT module names of their
# parts in row order; a fused name (Phi-3's) covers every part of its linear
LINEARS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
MLP_LINEARS = ("gate_up", "down")
SUPPORTED_MODULES = tuple(m for parts in LINEARS.values() for m in parts) + tuple(FUSED)

_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LinearShape:
    """A fused linear's input width and its parts' (module, first row, rows)."""

    inputs: int
    parts: tuple[tuple[str, int, int], ...]

    @property
    def outputs(self) -> int:
        return sum(rows for _, _, rows in self.parts)

    def rows_of(self, module: str) -> tuple[int, int]:
        """(first row, rows) of a PEFT module name in this linear's output."""
        if module in FUSED:
            return 0, self.outputs
        for name, first, rows in self.parts:
            if name == module:
                return first, rows
        raise KeyError(module)


def linear_shapes(cfg: ModelConfig) -> dict[str, LinearShape]:
    """Each adapted linear's shape in `cfg`'s model (the whole model's, not a rank's)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter, hidden = cfg.intermediate_size, cfg.hidden_size
    return {
        "qkv": LinearShape(hidden, (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))),
        "o": LinearShape(q, (("o_proj", 0, hidden),)),
        "gate_up": LinearShape(hidden, (("gate_proj", 0, inter), ("up_proj", inter, inter))),
        "down": LinearShape(inter, (("down_proj", 0, hidden),)),
    }


def slot_ranks(max_rank: int) -> dict[str, int]:
    """The most rows a device slot holds for each linear's stacked A (every part of it at
    `max_rank`)."""
    return {name: len(parts) * max_rank for name, parts in LINEARS.items()}


@dataclass
class LoRAWeights:
    """One adapter in host memory, laid out for the engine (see the module's docstring)."""

    path: str
    digest: bytes  # blake2b of the config and weights files: the adapter's identity
    modules: tuple[str, ...]  # PEFT module names it adapts
    rank: int  # its largest module rank
    alpha: float
    # (layer, linear) -> (A [r_total, in], B [r_total, out]) with the scale in B
    layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.layers.values())

    def to(self, dtype: torch.dtype, pin: bool = False) -> LoRAWeights:
        layers = {}
        for key, (a, b) in self.layers.items():
            a, b = a.to(dtype), b.to(dtype)
            layers[key] = (a.pin_memory(), b.pin_memory()) if pin else (a, b)
        return LoRAWeights(self.path, self.digest, self.modules, self.rank, self.alpha, layers)


def read_adapter_config(path: str) -> dict:
    """The adapter's `adapter_config.json`, checked for what kvserve applies."""
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise AdapterError(f"LoRA adapter {path}: {what}; expected a PEFT adapter directory "
                           f"with {CONFIG_FILE} and {WEIGHTS_FILE}")
    cfg_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(cfg_path, "rb") as f:
            raw = f.read()
        cfg = json.loads(raw)
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter {path}: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{cfg_path}: unreadable or not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters "
                           "are served")
    refused = [
        (bool(cfg.get("use_dora")), "use_dora (DoRA)"),
        (cfg.get("bias", "none") not in (None, "none"), f"bias={cfg.get('bias')!r}"),
        (bool(cfg.get("modules_to_save")), f"modules_to_save={cfg.get('modules_to_save')!r}"),
        (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out"),
    ]
    for bad, what in refused:
        if bad:
            raise AdapterError(f"{cfg_path}: {what} is not supported; kvserve serves plain LoRA "
                               f"on {', '.join(SUPPORTED_MODULES)}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        other = sorted(set(targets) - set(SUPPORTED_MODULES))
        if other:
            raise AdapterError(f"{cfg_path}: target module(s) {', '.join(other)} not supported; "
                               f"kvserve adapts {', '.join(SUPPORTED_MODULES)}")
    cfg["_raw"] = raw
    return cfg


def load_adapter(path: str, model: ModelConfig, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAWeights:
    """Read and check a PEFT adapter for `model`; AdapterError on anything kvserve cannot
    apply exactly (nothing is kept then)."""
    path = os.path.expanduser(os.fspath(path))
    cfg = read_adapter_config(path)
    w_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(w_path):
        alt = " (adapter_model.bin is not read: convert it to safetensors)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise AdapterError(f"LoRA adapter {path}: no {WEIGHTS_FILE}{alt}")
    try:
        with open(w_path, "rb") as f:
            blob = f.read()
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(blob)
    except Exception as e:
        raise AdapterError(f"{w_path}: corrupt or unreadable safetensors file: {e}") from None
    digest = hashlib.blake2b(cfg["_raw"] + b"\0" + blob, digest_size=16).digest()
    return _layout(path, w_path, cfg, tensors, model, max_rank, dtype, digest)


def _pattern_value(patterns: dict, module_path: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module's name or a
    dotted suffix of it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return float(value)
    return default


def _layout(path: str, w_path: str, cfg: dict, tensors: dict[str, torch.Tensor],
            model: ModelConfig, max_rank: int, dtype: torch.dtype, digest: bytes) -> LoRAWeights:
    shapes = linear_shapes(model)
    # (layer, module) -> {"A": tensor, "B": tensor}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            what = key.rsplit(".weight", 1)[0]
            raise AdapterError(f"{w_path}: tensor {key!r} is not a LoRA A/B weight of a "
                               f"decoder layer's {', '.join(SUPPORTED_MODULES)} ({what} cannot "
                               "be adapted)")
        layer, module, which = int(m[1]), m[3], m[4]
        if module not in SUPPORTED_MODULES:
            raise AdapterError(f"{w_path}: target module {module!r} (tensor {key!r}) is not "
                               f"supported; kvserve adapts {', '.join(SUPPORTED_MODULES)}")
        if not 0 <= layer < model.num_layers:
            raise AdapterError(f"{w_path}: tensor {key!r} is for layer {layer}; the base model "
                               f"has {model.num_layers} layers (an adapter of another model?)")
        if t.dim() != 2 or not t.is_floating_point():
            raise AdapterError(f"{w_path}: tensor {key!r} is {t.dtype} of shape "
                               f"{list(t.shape)}; expected a 2-D float matrix")
        found.setdefault((layer, module), {})[which] = t
    if not found:
        raise AdapterError(f"{w_path}: no LoRA weights in it")
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora"))
    # group each layer's modules by the fused linear they add to
    per_linear: dict[tuple[int, str], list[tuple[str, torch.Tensor, torch.Tensor, float]]] = {}
    top_rank = 0
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"{w_path}: layer {layer} {module} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        linear = FUSED.get(module) or next(n for n, parts in LINEARS.items() if module in parts)
        if linear in MLP_LINEARS and model.is_moe_layer(layer):
            raise AdapterError(f"{w_path}: layer {layer} {module}: the base model's layer "
                               f"{layer} is a Mixture-of-Experts block; kvserve adapts its "
                               "attention only")
        shape = shapes[linear]
        _, rows = shape.rows_of(module)
        r = a.shape[0]
        if a.shape[1] != shape.inputs or tuple(b.shape) != (rows, r):
            raise AdapterError(
                f"{w_path}: layer {layer} {module} has lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)}; the base model ({model.name or model.architecture}) needs "
                f"[r, {shape.inputs}] and [{rows}, r]: an adapter for another base model")
        if r > max_rank:
            raise AdapterError(f"LoRA adapter {path}: rank {r} (layer {layer} {module}) is above "
                               f"max_lora_rank {max_rank}; raise --max-lora-rank")
        if r < 1:
            raise AdapterError(f"{w_path}: layer {layer} {module} has rank 0")
        top_rank = max(top_rank, r)
        name = f"model.layers.{layer}.{'mlp' if linear in MLP_LINEARS else 'self_attn'}.{module}"
        r_cfg = _pattern_value(cfg.get("rank_pattern") or {}, name, float(cfg.get("r", r)))
        a_cfg = _pattern_value(cfg.get("alpha_pattern") or {}, name, alpha)
        if int(r_cfg) != r:
            raise AdapterError(f"{w_path}: layer {layer} {module} has rank {r}; "
                               f"{CONFIG_FILE} says {int(r_cfg)}")
        scale = a_cfg / (math.sqrt(r) if rslora else r)
        per_linear.setdefault((layer, linear), []).append((module, a, b, scale))
    out = LoRAWeights(path, digest, tuple(sorted({m for _, m in found})), top_rank, alpha)
    for (layer, linear), mods in per_linear.items():
        out.layers[(layer, linear)] = _stack(w_path, layer, linear, shapes[linear], mods, dtype)
    return out


def _stack(w_path: str, layer: int, linear: str, shape: LinearShape,
           mods: list[tuple[str, torch.Tensor, torch.Tensor, float]],
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear's stacked A [r_total, in] and block-diagonal B [r_total, out] (scaled)."""
    covered = torch.zeros(shape.outputs, dtype=torch.bool)
    r_total = sum(a.shape[0] for _, a, _, _ in mods)
    big_a = torch.empty(r_total, shape.inputs, dtype=torch.float32)
    big_b = torch.zeros(r_total, shape.outputs, dtype=torch.float32)
    at = 0
    for module, a, b, scale in mods:
        first, rows = shape.rows_of(module)
        if covered[first : first + rows].any():
            raise AdapterError(f"{w_path}: layer {layer} adapts {module} and another module "
                               f"covering the same rows of {linear}")
        covered[first : first + rows] = True
        r = a.shape[0]
        big_a[at : at + r] = a.float()
        big_b[at : at + r, first : first + rows] = b.float().t() * scale
        at += r
    return big_a.to(dtype).contiguous(), big_b.to(dtype).contiguous()
