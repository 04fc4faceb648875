"""From hidden states to what a call returns: pooling methods (``pooling``), heads (``heads``: one protocol),
the output kinds beyond one vector (``kinds``: tokens, sparse, ColBERT), multi-vector tools (``multivector``),
scoring (``scoring``: MaxSim, sparse dot, pair scores) and quantization (``quantize``)."""
