"""GPU kernels of the engine and their pure-torch references.

Each kernel has a ``@triton.jit`` body, a launcher that checks dtypes, shapes, strides and the
grid, and a torch reference with identical semantics:

- paged attention, varlen causal attention over a paged KV cache (prefill, prefill with a cached
  prefix, chunked prefill and decode in one code path), split-KV for long contexts:
  :mod:`.paged_attention_inputs` (the call, its layout and checks), :mod:`.paged_attention_triton`
  (the kernel and its launcher), :mod:`.paged_attention_reference` (the torch reference and the
  decode helpers the CPU planner shares);
- :mod:`.kv_cache_ops`: writing new K/V into their slots, block copies (copy-on-write) and swaps
  between a GPU and a CPU pool;
- :mod:`.triton_runtime`: whether triton imports, runs interpreted, and can launch on a device.

Device policy: on CUDA the engine runs the Triton kernels; on CPU it runs the torch references,
which are batched to be fast (they are the CPU execution path, not only a test oracle), except
decode attention over fp32 pools, which goes through :mod:`quire_engine.cpu.native` (a C kernel
compiled on first use that reads blocks in place) when a C compiler can build it.

The package itself exports nothing: import each name from the module that defines it, so no
submodule depends on the order in which this package initialises.
"""
