"""The README's client snippets, run as written against a real server (only the port
differs): a `curl` call and an `openai`-client script, each saving a reply's text and WAV.
The README holds them verbatim: they are copied from here."""

import io
import subprocess
import sys
from pathlib import Path

import soundfile

README = (Path(__file__).parents[2] / "README.md").read_text()

CURL = """\
curl -s http://127.0.0.1:8091/v1/chat/completions -H 'Content-Type: application/json' -d '{
  "model": "omni_chat",
  "messages": [{"role": "user", "content": "Hello! Who are you?"}],
  "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"},
  "max_tokens": 24, "max_audio_tokens": 240, "seed": 7
}' > reply.json
python3 -c 'import base64, json; m = json.load(open("reply.json"))["choices"][0]["message"]
open("reply.txt", "w").write(m["content"])
open("reply.wav", "wb").write(base64.b64decode(m["audio"]["data"]))'
"""

PYTHON = """\
import base64

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8091/v1", api_key="unused")
reply = client.chat.completions.create(
    model="omni_chat",
    messages=[{"role": "user", "content": "Hello! Who are you?"}],
    modalities=["text", "audio"],
    audio={"voice": "Chelsie", "format": "wav"},
    max_tokens=24,
    seed=7,  # the same seed replays the same reply
    extra_body={"max_audio_tokens": 240},  # a pipeline parameter
)
message = reply.choices[0].message
open("reply.txt", "w").write(message.content)
open("reply.wav", "wb").write(base64.b64decode(message.audio.data))
"""


def check_reply(folder: Path) -> None:
    assert (folder / "reply.txt").read_text()
    samples, rate = soundfile.read(io.BytesIO((folder / "reply.wav").read_bytes()))
    assert rate == 24000 and len(samples) > 0


def test_the_readme_shows_these_snippets():
    assert f"```bash\n{CURL}```" in README
    assert f"```python\n{PYTHON}```" in README
    assert "make serve" in README


def test_the_curl_call_saves_text_and_wav(served, tmp_path):
    script = CURL.replace("127.0.0.1:8091", served.base.removeprefix("http://"))
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True, timeout=120)
    check_reply(tmp_path)


def test_the_openai_snippet_saves_text_and_wav(served, tmp_path):
    script = PYTHON.replace("127.0.0.1:8091", served.base.removeprefix("http://"))
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=120)
    check_reply(tmp_path)
