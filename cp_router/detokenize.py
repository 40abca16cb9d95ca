"""Incremental detokenization of one request's output, with stop strings matched on the text.

Text is released as soon as it is complete (no dangling UTF-8 bytes) and cannot be the start of a stop
string; everything after a stop string is never released, nor the stop string itself unless
`include_stop` (vLLM's include_stop_str_in_output). Special tokens are dropped from the text unless
`skip_special_tokens` is False (their ids are returned either way).
"""

from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.skip_special_tokens, self.include_stop = skip_special_tokens, include_stop
        self.ids: list[int] = []
        self.text = ""  # decoded so far (complete characters only)
        self.released = 0  # characters of `text` handed out
        self._prefix_offset = self._read_offset = 0
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Appends one token; sets `stopped` (and cuts `text` before the stop string) when one appears."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        new_text = self.tokenizer.decode(self.ids[self._prefix_offset :], skip_special_tokens=skip)
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return  # an incomplete character: wait for the next token
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        hits = [(i, i + len(s)) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
        if hits:
            start, end = min(hits)
            self.text, self.stopped = self.text[: end if self.include_stop else start], True

    def release(self, final: bool) -> str:
        """New text to hand out; unless final, hold back a tail that could begin a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            for stop in self.stop:
                for n in range(min(len(stop) - 1, end), 0, -1):
                    if self.text.endswith(stop[:n]):
                        end = min(end, len(self.text) - n)
                        break
        end = max(end, self.released)
        delta, self.released = self.text[self.released : end], end
        return delta
