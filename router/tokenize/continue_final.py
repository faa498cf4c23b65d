"""``continue_final_message``: tag the last message, render, cut at the tag (as
transformers does)."""

from __future__ import annotations

from typing import Any

from router.tokenize.base import TokenizeError

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final_message(conversation: list[dict[str, Any]], source: str) -> str:
    """Mark the end of the last message's text (transformers' continue_final_message)."""
    final = conversation[-1].get("content")
    if "content" not in source:
        raise TokenizeError("continue_final_message: the chat template never reads 'content'")
    if isinstance(final, list):
        for part in reversed(final):
            if "text" in part:
                text = str(part["text"])
                part["text"] = text + CONTINUE_TAG
                return text
        raise TokenizeError("continue_final_message: the final message has no text to continue")
    if not isinstance(final, str):
        raise TokenizeError("continue_final_message: the final message has no content")
    conversation[-1]["content"] = final + CONTINUE_TAG
    return final


def cut_at_tag(rendered: str, final_text: str) -> str:
    """Drop everything from the tag on, as transformers does (rstrip if it was trimmed)."""
    tag = CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise TokenizeError(
            "continue_final_message: the final message does not appear in the rendered chat"
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()
