"""omniflow.checkpoints: builders of random-weight checkpoints of the real architectures.

`tiny` builds (and caches) the tiny offline checkpoints the tests, examples and `--tiny`
run on, and runs the unsplit reference generations they are compared against;
`tiny_recipes` says what goes into each, `tiny_tokenizer` trains their tokenizer; `scaled`
builds real-size Qwen2.5-Omni checkpoints for measuring on a GPU.

Builders, not serving code: the compiler and the runtime never import this package, except
`omniflow.catalog.resolve.model_path`, which builds a `tiny:` model on first use.
"""
