"""The xgrammar backend (GRAMMAR_BACKENDS["xgrammar"]): JSON schema, any JSON object, regex, a choice of strings,
EBNF and structural tags, compiled against the checkpoint's tokenizer.json."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr
from tokenizers import Tokenizer

from cp_router.grammar_spec import GrammarSpec
from model_workers.grammar.backend import GrammarError, TokenizerVocab

# JSON may put whitespace between its tokens, and a model can keep writing it forever: at most this many in a row
# (pretty-printed JSON indented 2 spaces per level fits up to 9 levels deep)
MAX_JSON_WHITESPACE = 20
ANY_JSON_OBJECT = '{"type": "object"}'
# String formats xgrammar's grammars are looser on than JSON Schema, spelled as exact patterns: ipv4 without leading
# zeros ("031"), dates with a day the month has (February stops at 28: a 29th is never invalid-free without the
# year's leap rule); formats and patterns whose maxLength xgrammar would ignore (it warns) get bounded ones.
OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
DATE = ("[0-9]{4}-(((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01]))|((0[469]|11)-(0[1-9]|[12][0-9]|30))"
        "|(02-(0[1-9]|1[0-9]|2[0-8])))")
TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"ipv4": f"^{OCTET}(\\.{OCTET}){{3}}$", "date": f"^{DATE}$", "date-time": f"^{DATE}T{TIME}$"}
SIMPLE_PATTERN = re.compile(r"\^(\[[^\]\\]+\]|\\[dw])([+*])\$")  # ^[a-c]+$, ^\d*$: one class repeated
LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+:[0-9]+: ")  # "[13:08:43] /project/cpp/regex_converter.cc:94: "


def tokenizer_info(vocab: TokenizerVocab) -> xgr.TokenizerInfo:
    """Each id's token as tokenizer.json spells it (byte-level or raw: detected from the file, as xgrammar's
    Hugging Face path does); ids past the tokenizer up to the model's vocabulary are never allowed."""
    by_id = Tokenizer.from_str(vocab.tokenizer_json).get_vocab(with_added_tokens=True)
    encoded = [""] * (max(by_id.values()) + 1)
    for token, token_id in by_id.items():
        encoded[token_id] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(vocab.tokenizer_json)
    return xgr.TokenizerInfo(encoded[: vocab.vocab_size], metadata["vocab_type"], vocab_size=vocab.vocab_size,
                             stop_token_ids=[], add_prefix_space=metadata["add_prefix_space"])


def exact_formats(schema):
    """The schema with the string formats xgrammar is looser on than JSON Schema spelled as patterns (ipv4)."""
    if isinstance(schema, list):
        return [exact_formats(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: exact_formats(value) for key, value in schema.items()}
    if out.get("format") in FORMAT_PATTERNS and "pattern" not in out:
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
    if out.get("format") == "email" and "maxLength" in out and "pattern" not in out:
        out.pop("format")
        out["pattern"] = bounded_email(out.pop("maxLength"))
        out.pop("minLength", None)
    simple = SIMPLE_PATTERN.fullmatch(out.get("pattern", "")) if "maxLength" in out else None
    if simple is not None:
        low = max(out.pop("minLength", 0), 1 if simple.group(2) == "+" else 0)
        out["pattern"] = f"^{simple.group(1)}{{{low},{out.pop('maxLength')}}}$"
    return out


def bounded_email(max_length: int) -> str:
    """An address of at most `max_length` characters: local@label.tld."""
    local = max(1, (max_length - 5) // 2)
    tld = max(2, min(6, max_length - local - 3))
    label = max(1, max_length - local - tld - 2)
    return f"^[A-Za-z0-9._%+-]{{1,{local}}}@[A-Za-z0-9-]{{1,{label}}}\\.[A-Za-z]{{2,{tld}}}$"


def choice_ebnf(source: str) -> str:
    """A JSON list of strings -> an EBNF grammar whose root is exactly one of them."""
    choices = json.loads(source)
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class XGrammarMatcher:
    def __init__(self, matcher: xgr.GrammarMatcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        self._matcher.fill_next_token_bitmask(bitmask.view(1, -1))

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarCompiled:
    def __init__(self, compiled: xgr.CompiledGrammar):
        self.compiled = compiled

    @property
    def memory_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, vocab: TokenizerVocab):
        self.vocab_size = vocab.vocab_size
        # compile_cache.py is the one cache (bounded in entries and bytes); xgrammar's own stays off
        self._compiler = xgr.GrammarCompiler(tokenizer_info(vocab), max_threads=2, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> XGrammarCompiled:
        try:
            return XGrammarCompiled(self._compile(spec))
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse and schema errors
            reason = LOG_PREFIX.sub("", " ".join(str(exc).split()))[:500]
            raise GrammarError(f"{spec.label or spec.kind}: the {spec.kind} does not compile: {reason}") from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind in ("json_schema", "json_object"):
            schema = json.dumps(exact_formats(json.loads(spec.source))) if spec.kind == "json_schema" \
                else ANY_JSON_OBJECT
            return self._compiler.compile_json_schema(schema, strict_mode=spec.strict,
                                                      max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.source)
        if spec.kind == "choice":
            return self._compiler.compile_grammar(choice_ebnf(spec.source))
        if spec.kind == "ebnf":
            return self._compiler.compile_grammar(spec.source)
        return self._compile_structural_tag(json.loads(spec.source))

    def _compile_structural_tag(self, tag: dict) -> xgr.CompiledGrammar:
        if "structures" in tag:  # the first structural tag format (vLLM's and SGLang's older requests)
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in tag["structures"]]
            return self._compiler.compile_structural_tag(items, tag.get("triggers", []))
        return self._compiler.compile_structural_tag(json.dumps(tag))

    def matcher(self, compiled: XGrammarCompiled, stop_ids: tuple[int, ...]) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.compiled, override_stop_tokens=list(stop_ids)))
