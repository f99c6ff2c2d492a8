"""EAGLE-3 heads saved in this library's layout and in the two public ones, loaded as :class:`Eagle3Head`.

Three layouts, each a directory with a ``config.json`` and one weights file (``model.safetensors``, or a
``pytorch_model.bin`` is refused with a message: the library never unpickles, convert it to
safetensors once, yourself):

- ``"specdec"``: this library's (:func:`specdec.drafters.heads.save_heads`): ``config.json`` is
  :class:`HeadConfig` with ``"method": "eagle3"``; weights carry :class:`Eagle3Head`'s own names
  (``fc.weight``, ``layer.qkv_proj.weight`` fused, ``layer.gate_up_proj.weight`` fused, ...).
- ``"safeailab"``: the paper's code, SafeAILab/EAGLE (``eagle/model/cnets.py``, class ``Model``, trained
  by ``eagle/traineagle3``; also what SpecForge saves). ``config.json`` is a transformers Llama config
  (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``rms_norm_eps``, ``hidden_act``, ``rope_theta``, ``rope_scaling``, ``vocab_size``)
  plus ``draft_vocab_size`` (absent: the full vocabulary, as vLLM reads it) and optionally
  ``target_hidden_size``, ``norm_before_residual`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``
  (SpecForge). Weights: ``fc.weight`` ``[H, 3H]``; ``midlayer.`` + ``self_attn.{q,k,v,o}_proj.weight``,
  ``mlp.{gate,up,down}_proj.weight``, ``input_layernorm.weight``, ``hidden_norm.weight``,
  ``post_attention_layernorm.weight``; ``norm.weight``; ``lm_head.weight`` ``[V_d, H]``; buffers
  ``d2t`` ``[V_d]`` int64 and ``t2d`` ``[V]`` bool; often the target's ``embed_tokens.weight``.
- ``"speculators"``: vLLM's ``speculators`` project (``src/speculators/models/eagle3``, class
  ``Eagle3SpeculatorConfig``; read by vLLM's ``vllm/transformers_utils/configs/speculators/algos.py``).
  ``config.json`` has ``"speculators_model_type": "eagle3"``, ``transformer_layer_config`` (a
  transformers config of the one decoder layer, saved as a diff against its class's defaults, so a field
  left out takes the transformers default), ``draft_vocab_size``, ``norm_before_residual``,
  ``target_hidden_size`` (null: the layer's hidden size), ``eagle_aux_hidden_state_layer_ids`` and
  ``speculators_config`` (proposal methods, verifier). Weights as SafeAILab's with ``layers.0.`` in
  place of ``midlayer.`` (and ``self_attn.q_norm``/``k_norm`` for a Qwen3 layer).

How the public layouts become an :class:`Eagle3Head`: separate ``q_proj``/``k_proj``/``v_proj`` are
stacked into ``layer.qkv_proj`` (q rows, then k, then v) and ``gate_proj``/``up_proj`` into
``layer.gate_up_proj`` (gate rows, then up); ``midlayer.*`` and ``layers.0.*`` become ``layer.*`` (either
prefix is accepted in both layouts, as vLLM does). The target's token embedding is not part of the head:
a stored ``embed_tokens.weight`` is only checked against the target's ``[V, H]`` and dropped. Without
``d2t``/``t2d`` the draft vocabulary is the whole vocabulary (identity maps); one of the two alone gives
the other.

The head's decoder layer is the checkpoint's, not a copy of the target's: the target's
:class:`ModelArchConfig` with the attention shape (``num_attention_heads``, ``num_key_value_heads``,
``head_dim``), ``intermediate_size``, ``rms_norm_eps``, ``hidden_act`` and RoPE (``rope_theta`` and
``rope_scaling`` through transformers' initialisers: a head trained with ``rope_theta`` 10000 on a
Llama-3 target keeps 10000) of the checkpoint's config replaced (:func:`dataclasses.replace`), biases
and ``q_norm``/``k_norm`` as the weights have them, and the layer a plain Llama-style one: RMSNorm
``w * norm(x)``, softmax scale ``head_dim ** -0.5``, global attention, no soft-capping, whatever the
target's family (both projects implement Llama and Qwen3 layers only). ``num_layers`` stays the
target's (it bounds the feature layers).

Feature layers: the config's ``eagle_aux_hidden_state_layer_ids`` (top level, or under
``eagle_config``) when given, else :func:`default_feature_layers` of the target, ``(2, L // 2, L -
3)``, SafeAILab's hard-coded choice and the default of vLLM and ``speculators``. The index convention is
the same everywhere: index ``i`` is the residual stream *entering* target layer ``i`` (transformers'
``hidden_states[i]``): SafeAILab's ``modeling_llama_kv.py`` appends ``hidden_states`` before running
layer ``idx``, vLLM's ``llama.py`` appends ``hidden_states + residual`` before running layer ``idx``
(the same stream, its residual not yet folded in), and :meth:`DecoderLM.set_feature_layers` takes the
stream entering layer ``i``; index ``L`` is the last layer's output before the final norm in vLLM and
here alike (transformers' ``hidden_states[L]`` has the final norm applied). The ids are used as they are.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from specdec.drafters.eagle3_head import Eagle3Head, check_vocab_maps, default_feature_layers, vocab_maps
from specdec.drafters.heads import HeadConfig, arch_fields, check_eagle3_fits, head_arch
from specdec.errors import ConfigError, CorruptModelError, InvalidRequestError
from specdec.models.config import ModelArchConfig

LAYOUTS = ("specdec", "safeailab", "speculators")
WEIGHT_FILES = ("model.safetensors",)
#: Pickled weights some public heads ship; refused (this library never unpickles), with how to convert.
PICKLED_WEIGHTS = "pytorch_model.bin"

#: Checkpoint names outside the decoder layer that map to ours unchanged.
_TOP_LEVEL = ("fc.weight", "norm.weight", "lm_head.weight")
#: Decoder-layer names (after the ``midlayer.`` / ``layers.0.`` prefix) that map to ``layer.<name>``.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.o_proj.bias": "o_proj.bias",
    "self_attn.q_norm.weight": "q_norm.weight",
    "self_attn.k_norm.weight": "k_norm.weight",
    "mlp.down_proj.weight": "down_proj.weight",
    "mlp.down_proj.bias": "down_proj.bias",
}
#: Fused parameters of ours: (our name, checkpoint parts in row order).
_FUSED = (
    ("qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)
#: Stored by some checkpoints, not part of the head: the target's embedding (checked, then dropped) and
#: the ``speculators`` trainer's frozen copies of the verifier's final norm and LM head.
_IGNORED = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
#: ``speculators`` options our head does not implement (the "Eagle 3.1" variants).
_UNSUPPORTED_FLAGS = ("norm_before_fc", "norm_output", "fc_norm")
_LAYER_PREFIX = re.compile(r"^(midlayer|layers\.(\d+))\.")


def detect_eagle3_layout(directory: str | Path) -> str:
    """Which layout the EAGLE-3 head in ``directory`` is saved in (the module docstring has them).

    Returns:
        ``"specdec"`` (``config.json`` has ``"method": "eagle3"``), ``"speculators"`` (it has
        ``"speculators_model_type": "eagle3"``) or ``"safeailab"`` (neither, and the weights hold
        ``midlayer.*`` names, or vLLM's ``layers.0.hidden_norm.weight``).

    Raises:
        CorruptModelError: no directory, no or unreadable ``config.json``, no weights file, or none of the
            three layouts (the message names the config's keys and the first weight names found).
        ConfigError: a head of this library or of ``speculators`` for another method (named).
    """
    path = Path(directory)
    raw = _read_config(path)
    return _layout(path, raw, None)


def load_eagle3_head(
    directory: str | Path,
    target_arch: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[Eagle3Head, HeadConfig]:
    """Load the EAGLE-3 head in ``directory`` (any of :data:`LAYOUTS`) for a target of ``target_arch``.

    The ``"specdec"`` layout goes to :func:`specdec.drafters.heads.load_heads`; the public ones are read,
    checked against the target and the weights' own shapes, renamed and fused into our names, then loaded
    into an :class:`Eagle3Head` built as the module docstring says and checked by
    :func:`check_eagle3_fits`.

    Args:
        directory: the checkpoint directory.
        target_arch: the target's architecture.
        dtype, device: of the returned head (integer and boolean buffers keep theirs).

    Returns:
        ``(head, config)``: the head in eval mode, and a :class:`HeadConfig` describing it (for the public
        layouts ``training`` records ``{"layout": ..., "source": directory}``, and ``target`` the
        verifier's name when the checkpoint names one).

    Raises:
        InvalidRequestError: the head does not fit the target: hidden size (``hidden_size`` or
            ``target_hidden_size``), vocabulary (``vocab_size``, the length of ``t2d``, the shape of a stored
            ``embed_tokens.weight``), or feature layers outside ``[0, num_layers]``.
        CorruptModelError: unreadable, missing or inconsistent files: no layout recognised, a config
            field of the wrong type, ``draft_vocab_size`` outside ``[1, V]``, missing or unexpected weights,
            a weight of the wrong shape, ``d2t``/``t2d`` not describing one injective map, a
            ``speculators`` config without ``norm_before_residual``.
        ConfigError: a head this library does not implement: another method, more than one decoder layer,
            fused features of other than three layers, ``norm_before_fc``/``norm_output``/``fc_norm``, a
            non-zero ``fc.bias``.
        UnknownModelError: a RoPE type (``dynamic``, ``longrope``) or ``hidden_act`` that is not supported.

    Every check runs before the head is built.
    """
    path = Path(directory)
    raw = _read_config(path)
    weights_file = _weights_file(path)
    layout = _layout(path, raw, weights_file)
    if layout == "specdec":
        from specdec.drafters.heads import load_heads

        head, config = load_heads(str(path), target_arch, "eagle3", dtype, device)
        assert isinstance(head, Eagle3Head)
        return _float32_rope(head), config

    layer_cfg = _layer_config(path, layout, raw)
    arch, spec = _head_arch(path, layout, raw, layer_cfg, target_arch)
    ours, parts, ignored = _split_layer_names(path, _read_weights(weights_file))
    embed = ignored.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (target_arch.vocab_size, target_arch.hidden_size):
        raise InvalidRequestError(
            f"{path}: embed_tokens.weight has shape {list(embed.shape)}; the target's embedding is "
            f"[{target_arch.vocab_size}, {target_arch.hidden_size}]"
        )
    arch = dataclasses.replace(  # biases and per-head norms as the checkpoint has them
        arch,
        qkv_bias=("qkv_proj", "bias") in parts,
        o_bias="layer.o_proj.bias" in ours,
        mlp_bias=("gate_up_proj", "bias") in parts or "layer.down_proj.bias" in ours,
        qk_norm="layer.q_norm.weight" in ours or "layer.k_norm.weight" in ours,
    )
    ours.update(_fuse(path, parts, arch))
    ours["d2t"], ours["t2d"] = _vocab_maps(path, ours, spec["draft_vocab_size"], target_arch)
    build = (arch, spec["draft_vocab_size"], spec["feature_layers"], spec["norm_before_residual"])
    with torch.device("meta"):  # the expected names and shapes, without allocating or initialising
        expected = Eagle3Head(*build)
    _check_shapes(path, ours, {k: tuple(v.shape) for k, v in expected.state_dict().items()})

    head = Eagle3Head(*build)
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in ours.items()})
    check_eagle3_fits(head, target_arch, str(path))
    config = HeadConfig(
        method="eagle3",
        target=str(spec["target"]),
        hidden_size=target_arch.hidden_size,
        vocab_size=target_arch.vocab_size,
        arch=arch_fields(arch),
        training={"layout": layout, "source": str(path)},
        draft_vocab_size=spec["draft_vocab_size"],
        feature_layers=list(spec["feature_layers"]),
        norm_before_residual=spec["norm_before_residual"],
    )
    return _float32_rope(head.to(device=device, dtype=dtype).eval()), config


def _float32_rope(head: Eagle3Head) -> Eagle3Head:
    """Restore the RoPE frequencies to float32 after a cast to ``dtype`` rounded them (0.1 is 0.10009765625
    in bfloat16: angles off by a radian by position 10000), as the target's loader does."""
    head.inv_freq = torch.tensor(head.arch.inv_freq, dtype=torch.float32, device=head.inv_freq.device)
    return head


# --- reading the directory -----------------------------------------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CorruptModelError(f"no EAGLE-3 head directory at {path}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CorruptModelError(f"{path}/config.json is missing or not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CorruptModelError(f"{path}/config.json holds a {type(raw).__name__}, not an object")
    return raw


def _weights_file(path: Path) -> Path:
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    if (path / PICKLED_WEIGHTS).is_file():
        raise CorruptModelError(
            f"{path} holds {PICKLED_WEIGHTS} only: this library never unpickles weights; convert it once to "
            "model.safetensors (load it with torch's weights_only loader and write it with "
            "safetensors.torch.save_file) and load that directory"
        )
    found = sorted(p.name for p in path.iterdir())
    raise CorruptModelError(f"no {' or '.join(WEIGHT_FILES)} in {path} (found {found})")


def _weight_names(file: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (OSError, SafetensorError) as e:
        raise CorruptModelError(f"cannot read {file}: {e}") from e


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(file))
    except (OSError, SafetensorError, RuntimeError) as e:
        raise CorruptModelError(f"cannot read {file}: {e}") from e
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CorruptModelError(f"{file} is not a mapping of names to tensors")
    return state


def _layout(path: Path, raw: dict[str, Any], weights_file: Path | None) -> str:
    if "method" in raw:
        if raw["method"] != "eagle3":
            raise ConfigError(f"{path} holds specdec {raw['method']!r} heads, not eagle3")
        return "specdec"
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise ConfigError(
                f"{path} holds a speculators {raw['speculators_model_type']!r} model, not eagle3"
            )
        return "speculators"
    names = _weight_names(weights_file or _weights_file(path))
    if any(n.startswith("midlayer.") or n == "layers.0.hidden_norm.weight" for n in names):
        return "safeailab"
    raise CorruptModelError(
        f"{path} is not an EAGLE-3 head of a known layout ({', '.join(LAYOUTS)}): config.json has no "
        f"'method' or 'speculators_model_type' and the weights no 'midlayer.*' names (config keys "
        f"{sorted(raw)[:12]}, architectures {raw.get('architectures')}, weights {sorted(names)[:6]})"
    )


# --- the configs -----------------------------------------------------------------------------------------


def _layer_config(path: Path, layout: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The transformers config fields of the head's decoder layer."""
    if layout == "safeailab":
        return {k: v for k, v in raw.items() if k != "eagle_config"}
    layer_cfg = raw.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise CorruptModelError(
            f"{path}/config.json: speculators transformer_layer_config must be an object, got {layer_cfg!r}"
        )
    return layer_cfg


def _int_field(path: Path, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptModelError(f"{path}/config.json: {name} must be an integer, got {value!r}")
    return value


def _hf_config(path: Path, layer_cfg: dict[str, Any]):
    """``layer_cfg`` as its transformers config class (Llama when no ``model_type``), which fills the fields
    a checkpoint leaves out with the defaults the source projects read."""
    from transformers import AutoConfig

    fields = {k: v for k, v in layer_cfg.items() if k != "model_type"}
    model_type = layer_cfg.get("model_type") or "llama"
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers' validation of a user's file: whatever it raises
        raise CorruptModelError(
            f"{path}/config.json: the decoder layer's config ({model_type}) is invalid: "
            f"{type(e).__name__}: {e}"
        ) from e


def _head_arch(
    path: Path,
    layout: str,
    raw: dict[str, Any],
    layer_cfg: dict[str, Any],
    target: ModelArchConfig,
) -> tuple[ModelArchConfig, dict[str, Any]]:
    """Check a public config against the target; the head's arch and its other settings."""
    from specdec.models.config import _rope_inv_freq

    where = f"{path}/config.json"
    for flag in _UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise ConfigError(
                f"{where}: {flag} = {raw[flag]!r} is not supported by this library's EAGLE-3 head"
            )
    hf = _hf_config(path, layer_cfg)
    hidden = _int_field(path, "hidden_size", hf.hidden_size)
    if hidden != target.hidden_size:
        raise InvalidRequestError(
            f"{where}: the head's hidden_size is {hidden}; the target's hidden size is {target.hidden_size} "
            "(heads narrower than their target are not supported)"
        )
    target_hidden = raw.get("target_hidden_size")
    if (
        target_hidden is not None
        and _int_field(path, "target_hidden_size", target_hidden) != target.hidden_size
    ):
        raise InvalidRequestError(
            f"{where}: target_hidden_size is {target_hidden}; the target's hidden size is "
            f"{target.hidden_size}"
        )
    vocab = _int_field(path, "vocab_size", hf.vocab_size)
    if vocab != target.vocab_size:
        raise InvalidRequestError(
            f"{where}: vocab_size is {vocab}; the target's vocabulary has {target.vocab_size} tokens"
        )
    draft_vocab = raw.get("draft_vocab_size")
    draft_vocab = vocab if draft_vocab is None else _int_field(path, "draft_vocab_size", draft_vocab)
    if not 1 <= draft_vocab <= vocab:
        raise CorruptModelError(
            f"{where}: draft_vocab_size is {draft_vocab}, outside [1, vocab_size = {vocab}]"
        )
    if layout == "speculators":
        layers = _int_field(path, "num_hidden_layers", layer_cfg.get("num_hidden_layers", 1))
        if layers != 1:
            raise ConfigError(
                f"{where}: num_hidden_layers is {layers}; EAGLE-3 heads of one layer only are supported"
            )

    eagle_config = raw.get("eagle_config")
    eagle_config = eagle_config if isinstance(eagle_config, dict) else {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CorruptModelError(
                f"{where}: eagle_aux_hidden_state_layer_ids must be integers, got {ids!r}"
            )
        if len(ids) != 3:
            raise ConfigError(
                f"{where}: eagle_aux_hidden_state_layer_ids {ids}: heads fusing 3 layers only are supported"
            )
        bad = [i for i in ids if not 0 <= i <= target.num_layers]
        if bad:
            raise InvalidRequestError(
                f"{where}: eagle_aux_hidden_state_layer_ids {ids} has {bad} outside the target's "
                f"[0, num_layers = {target.num_layers}]"
            )
        feature_layers = tuple(ids)
    else:
        feature_layers = default_feature_layers(target.num_layers)

    if layout == "speculators":
        # speculators' Eagle3SpeculatorConfig defaults it to False, vLLM's reader (algos.py) to True
        if "norm_before_residual" not in raw:
            raise CorruptModelError(
                f"{where}: a speculators config without norm_before_residual is ambiguous"
            )
        norm_before_residual = raw["norm_before_residual"]
    else:
        # SafeAILab's cnets.py: the residual is taken before hidden_norm
        norm_before_residual = raw.get("norm_before_residual", False)
    if not isinstance(norm_before_residual, bool):
        raise CorruptModelError(
            f"{where}: norm_before_residual must be true or false, got {norm_before_residual!r}"
        )

    num_heads = _int_field(path, "num_attention_heads", hf.num_attention_heads)
    num_kv = _int_field(path, "num_key_value_heads", getattr(hf, "num_key_value_heads", None) or num_heads)
    head_dim = _int_field(path, "head_dim", getattr(hf, "head_dim", None) or hidden // num_heads)
    inv_freq, scaling = _rope_inv_freq(hf, head_dim)
    arch = head_arch(  # global attention without soft-capping, as every EAGLE head's layer
        dataclasses.replace(
            target,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            intermediate_size=_int_field(path, "intermediate_size", hf.intermediate_size),
            rms_norm_eps=float(hf.rms_norm_eps),
            hidden_act=str(getattr(hf, "hidden_act", "silu")),
            inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(scaling),
            # a plain Llama-style layer, whatever the target's family (set from the weights: biases, qk_norm)
            norm_style="llama",
            post_norms=False,
            query_pre_attn_scalar=None,
            final_logit_softcapping=None,
        )
    )
    speculators_config = raw.get("speculators_config")
    verifier = speculators_config.get("verifier") if isinstance(speculators_config, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    spec = {
        "draft_vocab_size": draft_vocab,
        "feature_layers": feature_layers,
        "norm_before_residual": norm_before_residual,
        "target": str(name) if name else str(path),
    }
    return arch, spec


# --- the weights -----------------------------------------------------------------------------------------


def _split_layer_names(path: Path, state: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """A public checkpoint's tensors as ``(ours, parts, ignored)``: those renamed one to one into our names,
    the parts of our fused projections (``parts[("qkv_proj", "weight")]["self_attn.q_proj"]``), and
    those not part of the head.

    Raises:
        ConfigError: weights of a second decoder layer, or a non-zero ``fc.bias``.
        CorruptModelError: names that belong to no EAGLE-3 head.
    """
    ours: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    ignored: dict[str, torch.Tensor] = {}
    unexpected = []
    fused_parts = {part: fused for fused, names in _FUSED for part in names}
    for name, tensor in state.items():
        if name in _TOP_LEVEL or name in ("d2t", "t2d"):
            ours[name] = tensor
            continue
        if name in _IGNORED:
            ignored[name] = tensor
            continue
        if name == "fc.bias":  # speculators' first Eagle3Speculator had one; ours has none
            if torch.count_nonzero(tensor):
                raise ConfigError(
                    f"{path}: a non-zero fc.bias is not supported by this library's EAGLE-3 head"
                )
            continue
        match = _LAYER_PREFIX.match(name)
        if match is None:
            unexpected.append(name)
            continue
        if match.group(2) is not None and match.group(2) != "0":
            raise ConfigError(
                f"{path}: weights of decoder layer {match.group(2)} ({name}): EAGLE-3 heads of one layer "
                "only are supported"
            )
        rest = name[match.end() :]
        if rest in _LAYER_RENAMES:
            ours["layer." + _LAYER_RENAMES[rest]] = tensor
            continue
        module, _, kind = rest.rpartition(".")
        if module in fused_parts and kind in ("weight", "bias"):
            parts.setdefault((fused_parts[module], kind), {})[module] = tensor
            continue
        unexpected.append(name)
    if unexpected:
        raise CorruptModelError(
            f"{path}: weights that are not part of an EAGLE-3 head: {sorted(unexpected)[:8]}"
        )
    return ours, parts, ignored


def _fuse(
    path: Path, parts: dict[tuple[str, str], dict[str, torch.Tensor]], arch: ModelArchConfig
) -> dict[str, torch.Tensor]:
    """Stack the parts of ``layer.qkv_proj`` and ``layer.gate_up_proj`` (rows in the order of
    :data:`_FUSED`), each checked against its expected shape first.

    Raises:
        CorruptModelError: a part missing or of the wrong shape (the message names it and both shapes).
    """
    h = arch.hidden_size
    rows = {
        "self_attn.q_proj": arch.num_heads * arch.head_dim,
        "self_attn.k_proj": arch.num_kv_heads * arch.head_dim,
        "self_attn.v_proj": arch.num_kv_heads * arch.head_dim,
        "mlp.gate_proj": arch.intermediate_size,
        "mlp.up_proj": arch.intermediate_size,
    }
    columns = {"qkv_proj": 2 * h, "gate_up_proj": h}
    out = {}
    for fused, names in _FUSED:
        for kind in ("weight", "bias"):
            found = parts.get((fused, kind))
            if not found:
                continue
            missing = [n for n in names if n not in found]
            if missing:
                raise CorruptModelError(f"{path}: {kind}s of {missing} missing (needed with {sorted(found)})")
            for n in names:
                want = (rows[n], columns[fused]) if kind == "weight" else (rows[n],)
                if tuple(found[n].shape) != want:
                    raise CorruptModelError(
                        f"{path}: {n}.{kind} has shape {list(found[n].shape)}, expected {list(want)} "
                        f"(from the config: {arch.num_heads} heads, {arch.num_kv_heads} KV heads, head_dim "
                        f"{arch.head_dim}, intermediate_size {arch.intermediate_size}, hidden size {h})"
                    )
            out[f"layer.{fused}.{kind}"] = torch.cat([found[n] for n in names], dim=0)
    return out


def _vocab_maps(
    path: Path, ours: dict[str, torch.Tensor], draft_vocab: int, target: ModelArchConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` from the checkpoint: both, one (the other derived), or neither (identity maps for
    a full draft vocabulary).

    Raises:
        InvalidRequestError: ``t2d`` does not cover the target's vocabulary.
        CorruptModelError: ``d2t`` not of ``draft_vocab_size`` entries, maps that are not one injective
            map into the vocabulary, or neither map with a reduced draft vocabulary.
    """
    vocab = target.vocab_size
    d2t, t2d = ours.get("d2t"), ours.get("t2d")
    if t2d is not None and (t2d.dim() != 1 or t2d.shape[0] != vocab):
        raise InvalidRequestError(
            f"{path}: t2d has shape {list(t2d.shape)}; the target's vocabulary has {vocab} tokens"
        )
    if d2t is not None and (d2t.dim() != 1 or d2t.shape[0] != draft_vocab or d2t.is_floating_point()):
        raise CorruptModelError(
            f"{path}: d2t has shape {list(d2t.shape)} ({d2t.dtype}); expected [{draft_vocab}] integers "
            "(draft_vocab_size)"
        )
    try:
        if d2t is None and t2d is None:
            if draft_vocab != vocab:
                raise CorruptModelError(
                    f"{path}: no d2t or t2d for a draft vocabulary of {draft_vocab} < {vocab} tokens"
                )
            return vocab_maps(range(vocab), vocab)
        if d2t is None:
            assert t2d is not None
            ids = t2d.bool().nonzero().flatten().tolist()
            if len(ids) != draft_vocab:
                raise CorruptModelError(
                    f"{path}: t2d marks {len(ids)} tokens; draft_vocab_size is {draft_vocab}"
                )
            return vocab_maps(ids, vocab)
        d2t = d2t.long()
        if t2d is None:
            return vocab_maps((torch.arange(draft_vocab) + d2t).tolist(), vocab)
        t2d = t2d.bool()
        check_vocab_maps(d2t, t2d, vocab)
        return d2t, t2d
    except ConfigError as e:
        raise CorruptModelError(f"{path}: {e}") from e


def _check_shapes(path: Path, state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected weight present with its expected shape, nothing else.

    Raises:
        CorruptModelError: the first difference (name and both shapes), or missing / extra names.
    """
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CorruptModelError(
            f"{path}: weights missing {missing[:8]} / not expected {extra[:8]} for the head its config "
            "describes"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CorruptModelError(
                f"{path}: weight {name} (our name) has shape {list(state[name].shape)}, "
                f"expected {list(shape)}"
            )
