"""The model: what a worker loads and runs to turn token ids into vectors.

- ``encoder``: the small contract the worker uses (tokenize, collate, embed, serve_query): the
  loaded model and the forward path chosen once at start;
- ``load`` (with ``tokenizer``): the card, tokenizer, transformer and representation loaded;
- ``model_dir``: what a sentence-transformers directory asks for, read without it;
- representations (``base``): ``dense``, ``multivector``, ``sparse``, ``rerank``;
- ``heads``: BGE-M3's token heads (sparse, multi-vector) beside the dense vector;
- forward paths (``forward``: one interface, eager and the copies): ``frozen`` (TorchScript on
  CPU), ``int8`` (int8 copies on CPU), ``cuda_queries`` (the query stage's copy on CUDA), chosen
  once by ``choose`` on a CPU; ``packing`` (the varlen layout);
- ``precision`` (with ``heldout``, its held-out set): the compute dtype and the parity bar every
  path is held to; ``probe`` prints its verdict (``python -m embedfleet.workers.model.probe``);
- ``standin``: a stand-in for the model, for benchmarks of everything else.
"""
