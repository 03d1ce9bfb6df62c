"""TRL GRPO with sandboxed code rewards: a few training steps on CPU, nothing downloaded.

The model is a tiny, randomly initialised Llama and the tokenizer is built here from a small word
list (``tokenizers`` + ``PreTrainedTokenizerFast``), so the script runs anywhere TRL imports. A random
model writes garbage, so its completions score 0.0 (they define nothing the tests call); the point
is the wiring: ``GRPOTrainer(reward_funcs=[CodeReward(grader)])`` grades every completion of a
step against its row's ``tests`` column in the pool, one sandbox per test case, in one round trip.
Before training, the same reward grades a right, a wrong and a looping completion so you can see
the scores a real model would get::

    python examples/trl_grpo_rewards.py               # 4 steps
    python examples/trl_grpo_rewards.py --steps 2

Swap in ``AutoModelForCausalLM.from_pretrained(...)`` and its tokenizer to train for real.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen3_chat_template  # noqa: E402

from boltzlabs_gym.integrations.grading import Grader  # noqa: E402
from boltzlabs_gym.integrations.trl import CodeReward  # noqa: E402

#: Special tokens of the Qwen3 chat template (TRL ships it), so conversational and tool-calling
#: datasets render too.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
SPECIAL += ["<tool_response>", "</tool_response>", "<think>", "</think>"]
WORDS = ["def", "return", "print", "add", "a", "b", "1", "2", "3", "(", ")", ":", "=", "+", "-", ","]
WORDS += ["user", "assistant", "tool", "write", "code", "the"]

ADD_TESTS = {"assert_case": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
SAMPLES = {
    "right": "```python\ndef add(a, b):\n    return a + b\n```",
    "wrong": "```python\ndef add(a, b):\n    return a - b\n```",
    "loops": "```python\ndef add(a, b):\n    while True:\n        pass\n```",
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS` and the Qwen3 special tokens, with Qwen3's chat template."""
    vocab = {t: i for i, t in enumerate(["[UNK]", *SPECIAL, *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL[1:],
    )
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


def tiny_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    """A one-layer Llama with 16-wide hidden states, randomly initialised (seeded)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def tiny_config(output_dir: str, steps: int, **overrides) -> GRPOConfig:
    """GRPO on CPU: 2 completions per prompt, 8 tokens each, no checkpoints, no loggers."""
    options = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=steps,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        seed=0,
    )
    return GRPOConfig(**{**options, **overrides})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--run-timeout", type=float, default=1.0, help="seconds per test case")
    args = parser.parse_args()

    with Grader(run_timeout=args.run_timeout, envs_per_lane=4, lanes=1) as grader:
        reward = CodeReward(grader)
        names = list(SAMPLES)
        t0 = time.perf_counter()
        scores = reward(["write add"] * len(names), [SAMPLES[n] for n in names], tests=[ADD_TESTS] * len(names))
        print(f"hand-written completions graded in {time.perf_counter() - t0:.2f} s:")
        for name, score, info in zip(names, scores, reward.last_infos):
            print(f"  {name:6s} reward={score}  ({info['passed']}/{info['cases']} cases, {info['reason']})")

        tokenizer = tiny_tokenizer()
        rows = [{"prompt": "write code add a b", "tests": ADD_TESTS} for _ in range(args.steps)]
        with tempfile.TemporaryDirectory() as out:
            trainer = GRPOTrainer(
                model=tiny_model(tokenizer),
                processing_class=tokenizer,
                reward_funcs=[reward],
                args=tiny_config(out, args.steps),
                train_dataset=Dataset.from_list(rows),
            )
            t0 = time.perf_counter()
            trainer.train()
        print(f"trained {trainer.state.global_step} steps in {time.perf_counter() - t0:.2f} s")
        print(f"last step's rewards: {[i['score'] for i in reward.last_infos]}")
        print(f"last step's reasons: {sorted({i['reason'] for i in reward.last_infos})}")
        print(f"STEPS={trainer.state.global_step}")


if __name__ == "__main__":
    main()
