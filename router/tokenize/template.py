"""Chat-template rendering the way Hugging Face ``transformers`` does it.

vLLM renders chat prompts through ``tokenizer.apply_chat_template``, which compiles the
template in a jinja2 ``ImmutableSandboxedEnvironment`` with ``trim_blocks=True``,
``lstrip_blocks=True`` and the ``loopcontrols`` extension, and adds:

* ``raise_exception(msg)`` -> raises ``TemplateError(msg)``;
* a ``tojson`` filter = ``json.dumps(x, ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)`` (jinja's own filter would HTML-escape ``<>&'``);
* ``strftime_now(fmt)`` = ``datetime.now().strftime(fmt)``;
* ``dict`` and a ``namespace`` that refuses underscore-prefixed attribute names;
* the ``{% generation %}`` block tag (assistant-mask tracking; it renders its body as is).

The template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) and any extra keyword
arguments (``chat_template_kwargs``), which override the special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.tokenize.base import TokenizeError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` inside templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` that rejects underscore-prefixed names (sandbox hardening)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) a chat template; a syntax error becomes :class:`TokenizeError`."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizeError(f"chat template has a syntax error (line {exc.lineno}): {exc}") from exc


def parse_template(source: str) -> jinja2.nodes.Template:
    """The template's AST (used to detect the content format the template expects)."""
    return _environment().parse(source)


def render_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Render ``source`` exactly as ``transformers.render_jinja_template`` does.

    ``extra`` (``chat_template_kwargs``) overrides ``special_tokens`` when both name the
    same variable.  Errors raised by the template (``raise_exception``) and runtime
    errors become :class:`TokenizeError` carrying the template's own message.
    """
    template = compile_template(source)
    variables: dict[str, Any] = {**(special_tokens or {}), **(extra or {})}
    variables.pop("messages", None)
    try:
        return template.render(
            messages=list(messages),
            tools=None if tools is None else list(tools),
            documents=None if documents is None else list(documents),
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in variables.items() if k not in ("tools", "documents")},
        )
    except jinja2.TemplateError as exc:
        raise TokenizeError(f"chat template rejected the request: {exc}") from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise TokenizeError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
