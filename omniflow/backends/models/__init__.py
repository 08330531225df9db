"""omniflow.backends.models: the model-specific halves of the model backends.

One module per model family, each holding what the generic backends cannot know about it:
`qwen_omni` (Qwen2.5-Omni's thinker and talker for the transformers `ar` backend, and the
adapters of the edges between its stages), `qwen_omni_token2wav` (its token2wav vocoder),
`qwen_vl` (Qwen2.5-VL's language model on image embeddings) and `qwen_tts` (a codec LM
prompted with text and a voice). A backend finds them through the architecture registry
(`omniflow.backends.registry.ARCHITECTURES`), keyed by the checkpoint's architecture, and
imports one only when a stage loads such a checkpoint.
"""
