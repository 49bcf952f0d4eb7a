"""Audio uploads through the real `openai` SDK, the proxy under uvicorn and a real speech
upstream: a form goes to the upstream of its `model` field, streamed on as it comes, and a key
whose models are checked cannot slip another model past the check."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.e2e.conftest import config_file, proxy_process, serving_post

pytestmark = pytest.mark.e2e

KEYS = {"LIMITED_KEY": "sk-limited", "ALL_KEY": "sk-all"}


class Speech:
    """A transcription upstream: it reads each form whole, as a server does, and says what it
    heard: the model, the file's size."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, int]] = []

    async def transcribe(self, request: Request) -> Response:
        async with request.form(max_part_size=64 * 1024 * 1024) as form:
            upload = form["file"]
            assert not isinstance(upload, str)
            size = len(await upload.read())
            self.heard.append((str(form["model"]), size))
        return JSONResponse({"text": f"{size} bytes for {form['model']}"})


@pytest.fixture(scope="module")
def speech() -> Iterator[tuple[str, Speech]]:
    upstream = Speech()
    with serving_post("/v1/audio/transcriptions", upstream.transcribe) as url:
        yield url, upstream


@pytest.fixture(scope="module")
def audio_proxy(
    upstream_url: str, speech: tuple[str, Speech], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    folder = Path(tmp_path_factory.mktemp("audio-e2e"))
    speech_url, _ = speech
    config = {
        "auth": {
            "keys": [
                {"name": "limited", "key_env": "LIMITED_KEY", "agents": ["whisper-large-v3"]},
                {"name": "all", "key_env": "ALL_KEY", "agents": ["*"]},
            ]
        },
        "upstreams": {
            "scripted": {"base_url": upstream_url, "max_retries": 0},
            "speech": {"base_url": f"{speech_url}/v1", "max_retries": 0},
        },
        "default_upstream": "scripted",
        "models": {"whisper-large-v3": {"upstream": "speech", "model": "whisper-large-v3"}},
    }
    with proxy_process(config_file(folder, config), KEYS) as base:
        yield base


def sdk(base: str, secret: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=secret, max_retries=0)


def test_an_upload_goes_to_the_upstream_its_form_names(
    audio_proxy: str, speech: tuple[str, Speech]
) -> None:
    _, upstream = speech
    upstream.heard.clear()
    audio = secrets.token_bytes(3 * 1024 * 1024)  # past the 1 MiB read to find the model
    with sdk(audio_proxy, "sk-limited") as client:
        heard = client.audio.transcriptions.create(
            model="whisper-large-v3", file=("talk.wav", audio, "audio/wav"), language="en"
        )
        with pytest.raises(openai.PermissionDeniedError) as refused:
            client.audio.transcriptions.create(model="whisper-1", file=("a.wav", b"RIFF"))
    assert heard.text == f"{len(audio)} bytes for whisper-large-v3"
    assert (refused.value.code, refused.value.param) == ("model_not_allowed", "model")
    assert upstream.heard == [("whisper-large-v3", len(audio))]


def form_naming_two_models(boundary: str, audio: bytes) -> bytes:
    def field(name: str, value: str) -> bytes:
        disposition = f'Content-Disposition: form-data; name="{name}"'
        return f"--{boundary}\r\n{disposition}\r\n\r\n{value}\r\n".encode()

    upload = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    return (
        field("model", "whisper-large-v3")
        + upload
        + audio
        + b"\r\n"
        + field("model", "whisper-1")  # read last by the upstream's parser
        + f"--{boundary}--\r\n".encode()
    )


async def in_pieces(body: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def test_a_checked_key_cannot_name_a_second_model_after_its_file(
    audio_proxy: str, speech: tuple[str, Speech]
) -> None:
    """The upstream's parser takes the last `model`: a form that names one the key may use,
    then after its file another, is cut off before the second reaches the upstream, which
    never gets a whole form; a key whose models are not checked sends it on whole."""
    _, upstream = speech
    upstream.heard.clear()
    audio = secrets.token_bytes(2 * 1024 * 1024)
    body = form_naming_two_models("b0und", audio)
    headers = {"content-type": "multipart/form-data; boundary=b0und"}
    async with httpx.AsyncClient(base_url=audio_proxy, timeout=30) as client:
        cut = await client.post(
            "/v1/audio/transcriptions",
            content=in_pieces(body, 65_536),
            headers={**headers, "authorization": "Bearer sk-limited"},
        )
        whole = await client.post(
            "/v1/audio/transcriptions",
            content=in_pieces(body, 65_536),
            headers={**headers, "authorization": "Bearer sk-all"},
        )
    assert cut.status_code == 403, cut.text
    assert cut.json()["error"]["code"] == "model_not_allowed"
    assert whole.status_code == 200, whole.text
    assert upstream.heard == [("whisper-1", len(audio))]  # the unchecked key's only
