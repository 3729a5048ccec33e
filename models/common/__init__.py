"""Blocks every family shares: the decoder config and loop (``decoder``, with a per-layer hook),
norms, RoPE (1-D, Llama 3 scaling, M-RoPE), SwiGLU MLP, attention, the decoder's HF tensor map,
HF safetensors I/O, text inputs, counts, the vision attention and the tower's cp split, and the
``Family`` record each family fills in."""
