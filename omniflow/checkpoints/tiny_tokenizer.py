"""The offline tokenizer of omniflow's tiny checkpoints.

Nothing can be downloaded here, so no real Qwen tokenizer is available. This module trains
a small byte-level BPE with the `tokenizers` library on a built-in text, with exactly the
normalizer, pre-tokenizer and decoder of Qwen2's tokenizer, and wraps it as transformers'
`Qwen2Tokenizer` (a `PreTrainedTokenizerFast`) with Qwen's chat special tokens, in Qwen's
order, right after the learned vocabulary, and a ChatML chat template. Two flavours differ
only in special-token names and the template's media placeholders: `"qwen"` (Qwen2.5 and
Qwen2.5-VL names) and `"omni"` (Qwen2.5-Omni names, plus the named audio/image/video token
attributes its processor reads).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

# Every word of the Qwen-Image prompt template occurs here, so the template's system prefix
# tokenizes to the 34 tokens that QwenImagePipeline drops (`prompt_template_encode_start_idx`),
# as it does with the real Qwen tokenizer. The default system prompts, chat role names and
# the prompts the tests use are here too, so they tokenize to whole words.
CORPUS = """\
system
user
assistant
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of \
perceiving auditory and visual inputs, as well as generating text and speech.
Describe the image by detailing the color, shape, size, texture, quantity, text, spatial \
relationships of the objects and background:
Hello! How are you today? I am fine, thank you. What can I do for you?
Tell me a short story about a robot who learns to sing.
Once upon a time there was a small robot. It lived in a quiet town by the sea, and every \
morning it listened to the birds. One day it tried to sing, and the whole town came to hear.
A photo of a red cat sitting on a blue chair in the sun, high quality, detailed.
A watercolor painting of a mountain lake at sunrise, with green trees and white clouds.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
Please read this sentence aloud in a calm and friendly voice.
Good morning, and welcome to the show. The weather today is warm with a light wind.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 24 100 2025 3.14 50% $20.
Questions and answers: who, what, where, when, why, how? Yes, no, maybe; it depends.
"""

# Qwen-Image-Edit's prompt-template system prompt, and edit instructions the tests use. The
# image-edit checkpoint's tokenizer also learns these, so the template's prefix tokenizes to
# the 64 tokens QwenImageEditPipeline drops, as it does with the real tokenizer; the other
# checkpoints' vocabulary stays as it is.
EDIT_CORPUS = """\
Describe the key features of the input image (color, shape, size, texture, objects, \
background), then explain how the user's text instruction should alter or modify the image. \
Generate a new image that meets the user's requirements while maintaining consistency with \
the original input where appropriate.
Make the cat blue. Turn the sky into a sunset. Add a hat to the dog. Remove the background.
"""

# Qwen2.5's special tokens in its order (ids 151643.. in the real vocabulary).
QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2.5-Omni renames some of the same ids for audio and media.
OMNI_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)
# The named token attributes Qwen2_5OmniProcessor reads from its tokenizer.
OMNI_NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}

QWEN_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Omni only speaks when the system prompt is this one.
OMNI_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)

# ChatML; list contents may mix text with media parts, each rendered as its placeholder.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n@SYSTEM@<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}@IMAGE@"
    "{% elif part['type'] == 'video' %}@VIDEO@"
    "{% elif part['type'] == 'audio' %}@AUDIO@"
    "{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_PLACEHOLDERS = {
    "qwen": {
        "@SYSTEM@": QWEN_SYSTEM_PROMPT,
        "@IMAGE@": "<|vision_start|><|image_pad|><|vision_end|>",
        "@VIDEO@": "<|vision_start|><|video_pad|><|vision_end|>",
        # Qwen2.5 has no audio input.
        "@AUDIO@": "",
    },
    "omni": {
        "@SYSTEM@": OMNI_SYSTEM_PROMPT,
        "@IMAGE@": "<|vision_bos|><|IMAGE|><|vision_eos|>",
        "@VIDEO@": "<|vision_bos|><|VIDEO|><|vision_eos|>",
        "@AUDIO@": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    },
}
FLAVOURS = tuple(_PLACEHOLDERS)
# Enough room for every word of CORPUS to become one token.
_BPE_VOCAB_SIZE = 2048


def chat_template(flavour: str) -> str:
    """The jinja chat template of a tokenizer flavour."""
    template = _CHAT_TEMPLATE
    for marker, text in _PLACEHOLDERS[flavour].items():
        template = template.replace(marker, text)
    return template


def specials(flavour: str) -> tuple[str, ...]:
    """The special tokens of a flavour, in id order after the learned vocabulary."""
    return OMNI_SPECIALS if flavour == "omni" else QWEN_SPECIALS


def build_tokenizer(flavour: str = "qwen", extra_corpus: str = "") -> Qwen2Tokenizer:
    """Train the tiny BPE on CORPUS (and `extra_corpus` after it) and wrap it as a
    Qwen2Tokenizer of the given flavour.

    Deterministic: training is single-pass over a fixed text and the trainer breaks ties
    by pair order, so every call returns the same vocabulary and merges.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    if flavour not in _PLACEHOLDERS:
        raise ValueError(f"unknown tokenizer flavour '{flavour}' (known: {', '.join(FLAVOURS)})")
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((CORPUS + extra_corpus).splitlines(), trainer=trainer)
    bpe.decoder = decoders.ByteLevel()
    vocab = bpe.get_vocab()
    # The trained model exposes its merges only through its JSON form.
    merges = [tuple(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]]
    # Special tokens sit in the vocabulary at fixed ids right after the learned tokens, in
    # Qwen's order, rather than wherever add_tokens would append them.
    names = specials(flavour)
    vocab.update({token: len(vocab) + i for i, token in enumerate(names)})
    named = OMNI_NAMED_TOKENS if flavour == "omni" else {}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens=list(names[1:]),
        errors="replace",
        model_max_length=32768,
        chat_template=chat_template(flavour),
        **named,
    )


# Video prompts the Wan tests use, so the T5 tokenizer learns their words too.
VIDEO_CORPUS = """\
A cat walks on the grass, realistic style. A dog runs along a beach at sunset.
A red balloon floats over a city street; the camera slowly pans to the right.
dance monkey. blurry, low quality, static, overexposed, worst quality, ugly.
"""
# Pieces a T5 tokenizer's Unigram model may learn (the corpus has far fewer).
_UNIGRAM_VOCAB_SIZE = 1024


def build_t5_tokenizer(extra_corpus: str = VIDEO_CORPUS):
    """A tiny T5 tokenizer as google/umt5-xxl's is made (the tokenizer Wan's pipelines
    use): a SentencePiece-style Unigram over Metaspace pieces (NFKC-normalised), trained on
    CORPUS and `extra_corpus`, wrapped as transformers' `T5Tokenizer` with T5's specials
    first (`<pad>` 0, `</s>` 1, `<unk>` 2) and no sentinel ids; `add_special_tokens`
    appends `</s>`, as T5's does. Deterministic, like `build_tokenizer`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from tokenizers.trainers import UnigramTrainer
    from transformers import T5Tokenizer

    unigram = Tokenizer(models.Unigram())
    unigram.normalizer = normalizers.NFKC()
    unigram.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
        ]
    )
    trainer = UnigramTrainer(
        vocab_size=_UNIGRAM_VOCAB_SIZE,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    unigram.train_from_iterator((CORPUS + extra_corpus).splitlines(), trainer=trainer)
    # The trainer's EM runs in parallel threads: its scores differ in their last bits from
    # run to run, and pieces of equal score come out in either order. Rounded and sorted,
    # the vocabulary (ids and segmentation) is the same on every build.
    # The characters the trainer must keep are one run, in a hash set's order, each scored
    # 1e-4 below the one before: they get those scores in character order instead.
    trained = json.loads(unigram.to_str())["model"]["vocab"]
    specials, pieces = trained[:3], [list(v) for v in trained[3:]]
    run = [
        i
        for i in range(len(pieces))
        if len(pieces[i][0]) == 1
        and any(
            0 <= j < len(pieces)
            and len(pieces[j][0]) == 1
            and abs(abs(pieces[i][1] - pieces[j][1]) - 1e-4) < 1e-9
            for j in (i - 1, i + 1)
        )
    ]
    for i, char in zip(run, sorted(pieces[i][0] for i in run), strict=True):
        pieces[i][0] = char
    pieces = sorted(((p, round(score, 6)) for p, score in pieces), key=lambda v: (-v[1], v[0]))
    vocab = [(piece, score) for piece, score in specials] + pieces
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)
