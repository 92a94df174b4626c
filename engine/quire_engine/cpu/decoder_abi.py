"""The native decode step's call interface: ``DecoderArgs`` mirrors ``struct quire_decoder_args``
(``csrc/quire_native.h``) and ``DecoderDecode`` is the loaded ``quire_decoder_decode`` symbol,
which checks at load that the library's layer table and argument struct are the ones described
here. ``native`` loads the library and builds ``DecoderDecode`` from it (``decoder_decode()``);
``decoder.DecoderStack`` fills the arguments.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Protocol

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Loaded(Protocol):
    """What ``DecoderDecode`` reads of ``native.Library``."""

    @property
    def path(self) -> Path: ...

    @property
    def cdll(self) -> ctypes.CDLL: ...


class DecoderArgs(ctypes.Structure):
    """``struct quire_decoder_args`` (``csrc/quire_native.h``, which states every field's layout),
    field for field: addresses as ints (0 or None for NULL), sizes as ints. ``DecoderDecode``
    checks at load that the library's fields have these names at these offsets."""

    _fields_ = [
        # The model, fixed for the life of a DecoderStack.
        ("layers", _P),  # int64 [num_layers, layer_fields]: addresses in LAYER_FIELDS' order
        ("layer_fields", _I),  # len(LAYER_FIELDS)
        ("num_layers", _I),
        ("windows", _P),  # int64 [num_layers]: sliding window, 0 for none
        ("scales", _P),  # float32 [num_layers]
        ("embed", _P),  # [vocab_rows, hidden]
        ("final_norm", _P),  # [hidden]
        ("lm_head", _P),  # [vocab, hidden]
        ("lm_bias", _P),  # [vocab] or NULL
        ("vocab", _I),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("inter", _I),
        ("eps", ctypes.c_float),
        ("block_size", _I),
        ("kv_kind", _I),  # KV_KINDS[pool dtype]
        ("kv_fixed", _P),  # float32 [num_layers, 2]: fixed (K, V) scales, or NULL (dynamic)
        # The step.
        ("n", _I),
        ("ids", _P),  # int64 [n]
        ("cos", _P),  # [rope_rows_total, head_dim]
        ("sin", _P),
        ("rope_rows", _P),  # int64 [n]
        ("slots", _P),  # int64 [n]
        ("tables", _P),  # int32 [n, table_stride]
        ("table_stride", _I),
        ("lens", _P),  # int64 [n]
        ("logits", _P),  # float32 [n, vocab], written
        ("num_threads", _I),
    ]


class DecoderDecode:
    """The loaded ``quire_decoder_decode`` symbol. Its caller is ``decoder.DecoderStack``,
    which builds and checks every address and array it passes (see there): this class checks at
    load that the library's layer table and argument struct are the ones this module describes
    (by name, in order; a mismatch is a ``RuntimeError`` naming both), types the call and turns
    its failures into exceptions."""

    # One layer's addresses, in the order of enum quire_layer_field (csrc/quire_native.h).
    LAYER_FIELDS = (
        "input_norm", "q", "q_bias", "k", "k_bias", "v", "v_bias", "o", "o_bias", "post_norm",
        "gate", "gate_bias", "up", "up_bias", "down", "down_bias", "k_cache", "v_cache",
        "k_scale", "v_scale",
    )  # fmt: skip

    def __init__(self, lib: _Loaded) -> None:
        self.path = lib.path
        cdll = lib.cdll
        count = _I.in_dll(cdll, "quire_layer_field_count").value
        names = (ctypes.c_char_p * count).in_dll(cdll, "quire_layer_field_names")
        theirs = tuple((name or b"").decode() for name in names)
        if theirs != self.LAYER_FIELDS:
            raise RuntimeError(
                f"native decoder: {lib.path}'s layer table is {list(theirs)}, but native.py "
                f"fills {list(self.LAYER_FIELDS)}: the sources and their loader disagree"
            )
        count = _I.in_dll(cdll, "quire_decoder_arg_count").value
        arg_names = (ctypes.c_char_p * count).in_dll(cdll, "quire_decoder_arg_names")
        offsets = (_I * count).in_dll(cdll, "quire_decoder_arg_offsets")
        layout = [((a or b"").decode(), int(o)) for a, o in zip(arg_names, offsets, strict=True)]
        layout.append(("sizeof", _I.in_dll(cdll, "quire_decoder_args_size").value))
        mirror = [(f[0], getattr(DecoderArgs, f[0]).offset) for f in DecoderArgs._fields_]
        mirror.append(("sizeof", ctypes.sizeof(DecoderArgs)))
        if layout != mirror:
            raise RuntimeError(
                f"native decoder: {lib.path}'s struct quire_decoder_args is {layout} (name, "
                f"offset), but native.DecoderArgs is {mirror}: the sources and their loader "
                "disagree"
            )
        fn = cdll.quire_decoder_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(DecoderArgs)]
        self._fn = fn

    def __call__(self, args: DecoderArgs) -> None:
        """``quire_decoder_decode(&args)``."""
        failed = self._fn(ctypes.byref(args))
        if failed == 2:
            raise RuntimeError(
                "native decoder: its layer table or KV kind disagrees with the library"
            )
        if failed:
            raise MemoryError("native decoder: could not allocate its scratch memory")
