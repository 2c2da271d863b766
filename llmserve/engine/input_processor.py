"""The one place where prompts become token ids and are checked against the model.

The server, the offline `LLM` and the engine all go through here: plain text gets the tokenizer's
special tokens (a BOS where the model has one), a chat is rendered with the model's template and
tokenized without them (the template writes its own), and every request's length is checked by one
rule: prompt plus output must fit both the context (`max_model_len`) and the whole KV cache.
"""

from __future__ import annotations

from llmserve.sampling_params import SamplingParams


class ContextLengthError(ValueError):
    """A prompt (or prompt + max_tokens) longer than the model takes; `param` names the field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = "context_length_exceeded"


class InputProcessor:
    def __init__(self, tokenizer, chat_template: str | None, vocab_size: int, max_model_len: int,
                 kv_cache_tokens: int) -> None:
        self.tokenizer = tokenizer  # a transformers fast tokenizer
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens  # no sequence can be longer than the whole cache
        self.limit = min(max_model_len, kv_cache_tokens)

    def encode(self, text: str) -> list[int]:
        """A plain-text prompt's token ids."""
        return self.tokenizer.encode(text)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template writes a conversation's tools itself (Qwen2.5's does, SmolLM2's does not)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a plain prompt")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, tools=tools or None)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """A conversation's token ids, through the model's chat template (`tools`: OpenAI's tool objects, for
        a template that renders them)."""
        return self.tokenizer.encode(self.render_chat(messages, add_generation_prompt, tools),
                                     add_special_tokens=False)

    def output_budget(self, prompt_len: int, requested: int | None, default_cap: int | None = None,
                      prompt_param: str = "prompt") -> int:
        """How many tokens a request may generate: `requested`, or (None) whatever room the context leaves,
        at most `default_cap`. Raises ContextLengthError when the prompt leaves no room, or prompt +
        requested does not fit."""
        limit = self.limit
        what = "max_model_len" if limit == self.max_model_len else "the whole KV cache (kv_cache_memory_gb)"
        if prompt_len >= limit:
            raise ContextLengthError(
                f"the prompt is {prompt_len} tokens, but this model's maximum context length ({what}) is {limit} "
                "tokens, including at least one generated token", prompt_param)
        if requested is None:
            return min(limit - prompt_len, default_cap or limit)
        if prompt_len + requested > limit:
            raise ContextLengthError(
                f"this model's maximum context length ({what}) is {limit} tokens, but {prompt_len + requested} "
                f"were requested ({prompt_len} in the prompt, {requested} for the completion); reduce the prompt "
                "or max_tokens", "max_tokens")
        return requested

    def check_prompt_ids(self, token_ids: list[int]) -> None:
        """A prompt given as token ids: not empty, each in the vocabulary (before anything decodes them)."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")

    def check(self, token_ids: list[int], params: SamplingParams) -> int:
        """Everything a request is checked against the model for before it is queued; returns its output
        budget."""
        self.check_prompt_ids(token_ids)
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias must map token ids in [0, {vocab}) to biases")
        return self.output_budget(len(token_ids), params.max_tokens)
