"""The model: what a worker loads and runs to turn token ids into vectors.

- ``encoder``: the loaded model (tokenizer, transformer, pooling, the sentence-transformers
  modules after it) and the forward path chosen once at start;
- ``model_dir``: what a sentence-transformers directory asks for, read without it;
- ``heads``: BGE-M3's token heads (sparse, multi-vector) beside the dense vector;
- forward paths: ``frozen`` (TorchScript on CPU), ``int8`` (int8 copies on CPU),
  ``cuda_queries`` (the query lane's copy on CUDA), ``packing`` (the varlen layout);
- ``precision`` (with ``heldout``, its held-out set): the compute dtype and the parity bar every
  path is held to; ``probe`` prints its verdict (``python -m embedfleet.workers.model.probe``);
- ``standin``: a stand-in for the model, for benchmarks of everything else.
"""
