"""Ask an engine for the token ids: vLLM's ``POST /tokenize``.

Chat: ``{"model", "messages", "add_generation_prompt", "tools"?, "chat_template_kwargs"?}``;
completion: ``{"model", "prompt"}`` (vLLM then uses ``add_special_tokens=True``) ->
``{"tokens": [...], "count": n, "max_model_len": m}``.  Exact by construction (the engine
renders its own template) at the price of one loopback/LAN round trip per request.

The coroutines ``aencode_chat`` / ``aencode_prompt`` are what the gateway awaits (see
:class:`~router.tokenize.encoder.ChatEncoder`); the blocking ``encode_chat`` /
``encode_prompt`` of the :class:`~router.tokenize.base.PromptTokenizer` protocol exist for
offline tools and must not be called from an event loop.

Several base URLs may be given: a connection failure or a 5xx moves on to the next one;
a 4xx (the engine rejects the request itself) does not.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from router.tokenize.base import TokenizeError


class RemoteTokenizeError(TokenizeError):
    """``/tokenize`` failed; ``status`` is the HTTP status (None: no answer at all)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])[:500]
        if "message" in body:
            return str(body["message"])[:500]
        if "detail" in body:
            return str(body["detail"])[:500]
    return str(body)[:200]


def _classify(resp: httpx.Response, url: str) -> list[int] | RemoteTokenizeError:
    """Token ids, or the error to try the next pod with (5xx); raises on a 4xx."""
    if resp.status_code >= 500:
        return RemoteTokenizeError(
            f"{url}: HTTP {resp.status_code}: {_error_text(resp)}", resp.status_code
        )
    if resp.status_code != 200:
        raise RemoteTokenizeError(
            f"{url}: HTTP {resp.status_code}: {_error_text(resp)}", resp.status_code
        )
    return _tokens(resp, url)


def _tokens(resp: httpx.Response, url: str) -> list[int]:
    try:
        body = resp.json()
    except ValueError as exc:
        raise RemoteTokenizeError(f"{url}: /tokenize answered non-JSON", resp.status_code) from exc
    tokens = body.get("tokens") if isinstance(body, Mapping) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise RemoteTokenizeError(
            f"{url}: /tokenize answer has no 'tokens' list of non-negative ints", resp.status_code
        )
    return tokens


class RemoteTokenizer:
    """Token ids from a pod's ``POST /tokenize`` (vLLM, or ``kvroute sim``)."""

    approximate = False

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        model: str | None = None,
        client: httpx.AsyncClient | None = None,
        timeout: float = 10.0,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        """``tls``: the TLS context for ``https`` base URLs (the router passes its pods'
        one, ``PodTLS.context``: the same CA and verification as requests to pods);
        None = httpx's default trust store."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("RemoteTokenizer needs at least one base URL")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.timeout = timeout
        self._client = client
        self._own_client: httpx.AsyncClient | None = None
        self._tls = tls
        self.name = f"remote:{self.base_urls[0]}"

    # --- request bodies ------------------------------------------------------------------

    def chat_body(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> dict[str, Any]:
        """``add_special_tokens``: tokenize the rendered chat as a completion prompt
        (vLLM's Responses API does; chat does not)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise TokenizeError("messages must be a non-empty list of message objects")
        body: dict[str, Any] = {
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        if self.model:
            body["model"] = self.model
        if tools is not None:
            body["tools"] = list(tools)
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        if add_special_tokens:
            body["add_special_tokens"] = True
        return body

    def prompt_body(self, prompt: str) -> dict[str, Any]:
        if not isinstance(prompt, str):
            raise TokenizeError(f"prompt must be a string, got {type(prompt).__name__}")
        body: dict[str, Any] = {"prompt": prompt}
        if self.model:
            body["model"] = self.model
        return body

    def _verify(self) -> ssl.SSLContext | bool:
        https = any(u.startswith("https://") for u in self.base_urls)
        return self._tls() if self._tls is not None and https else True

    # --- async (the gateway's path) ------------------------------------------------------

    def _async_client(self) -> httpx.AsyncClient:
        if self._client is not None:
            return self._client
        if self._own_client is None:
            self._own_client = httpx.AsyncClient(timeout=self.timeout, verify=self._verify())
        return self._own_client

    async def _apost(self, body: dict[str, Any]) -> list[int]:
        client = self._async_client()
        last: RemoteTokenizeError | None = None
        for base in self.base_urls:
            url = base + "/tokenize"
            try:
                resp = await client.post(url, json=body, timeout=self.timeout)
            except httpx.HTTPError as exc:
                last = RemoteTokenizeError(f"{url}: {type(exc).__name__}: {exc}")
                continue
            result = _classify(resp, url)
            if isinstance(result, RemoteTokenizeError):
                last = result
                continue
            return result
        assert last is not None
        raise last

    async def aencode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        return await self._apost(
            self.chat_body(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
                add_special_tokens=add_special_tokens,
            )
        )

    async def aencode_prompt(self, prompt: str) -> list[int]:
        return await self._apost(self.prompt_body(prompt))

    async def aclose(self) -> None:
        if self._own_client is not None:
            await self._own_client.aclose()
            self._own_client = None

    # --- blocking (offline tools only) ---------------------------------------------------

    def _post(self, body: dict[str, Any]) -> list[int]:
        last: RemoteTokenizeError | None = None
        with httpx.Client(timeout=self.timeout, verify=self._verify()) as client:
            for base in self.base_urls:
                url = base + "/tokenize"
                try:
                    resp = client.post(url, json=body)
                except httpx.HTTPError as exc:
                    last = RemoteTokenizeError(f"{url}: {type(exc).__name__}: {exc}")
                    continue
                result = _classify(resp, url)
                if isinstance(result, RemoteTokenizeError):
                    last = result
                    continue
                return result
        assert last is not None
        raise last

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self._post(
            self.chat_body(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
        )

    def encode_prompt(self, prompt: str) -> list[int]:
        return self._post(self.prompt_body(prompt))
