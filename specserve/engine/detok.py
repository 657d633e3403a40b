"""Incremental detokenization with stop strings.

Byte-level BPE tokens can end inside a UTF-8 character; text is released only when it
decodes cleanly. Stop strings are matched across token boundaries and never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (up to a stop string)
        self.emitted = 0  # characters of self.text already released
        self.stopped = False
        self._decoded = ""  # text of ids[:_read]
        self._prefix = 0  # decode window start (context for the next delta)
        self._read = 0  # ids decoded into _decoded

    def push(self, ids: Sequence[int]) -> str:
        """Add committed ids; return newly released text."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        # Decode only a window (vLLM's offsets): the tokens since the last clean boundary,
        # with the previous round's tokens as context, so a round costs O(new tokens), not
        # O(output) (~84 us at 192 tokens here, on the router's per-round path).
        context = self.tokenizer.decode(self.ids[self._prefix : self._read],
                                        skip_special_tokens=True)
        window = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
        if window.endswith("\ufffd") or not window.startswith(context):
            return ""  # wait for the rest of a multi-byte character
        self._decoded += window[len(context) :]
        self._prefix, self._read = self._read, len(self.ids)
        text = self._decoded
        if self.stop:
            hold = max(len(s) for s in self.stop) - 1
            search_from = max(0, self.emitted - hold)
            cut = min((i for s in self.stop if (i := text.find(s, search_from)) >= 0),
                      default=-1)
            if cut >= 0:
                text = text[:cut]
                self.stopped = True
            else:
                # hold back a tail that could be the start of a stop string
                safe = len(text) - hold
                self.text = text
                out = text[self.emitted : max(self.emitted, safe)]
                self.emitted += len(out)
                return out
        self.text = text
        out = text[self.emitted :]
        self.emitted = len(text)
        return out

    def flush(self) -> str:
        """At the end: release text held back for stop-string matching."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
