"""The issue's call (``max_new_tokens=40000`` stopped after 20 tokens), shared by
``test_memory_growth.py`` and the fresh processes it measures in (which import nothing else of
the tests, so that they also run against an older hf_magicdec)."""

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from conftest import ragged_prompts

BIG = dict(layers=2, max_position_embeddings=65536, hidden_size=128, intermediate_size=256, num_attention_heads=4,
           num_key_value_heads=4)  # 4 × 512 prompts: 40K slots of KV would be ~330 MB, the prompt's ~4 MB
PROMPT, BATCH, STOP_AFTER, MAX_NEW = 512, 4, 20, 40_000


class StopAfter(StoppingCriteria):
    """A user stopping criterion: every row stops after ``n`` new tokens."""

    def __init__(self, n, prompt):
        self.n, self.prompt = n, prompt

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.prompt >= self.n, dtype=torch.bool)


def big_call(speculative):
    ids, mask = ragged_prompts(batch=BATCH, length=PROMPT, seed=0, min_len=PROMPT // 2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                  stopping_criteria=StoppingCriteriaList([StopAfter(STOP_AFTER, PROMPT)]))
    if speculative:
        kwargs.update(speculative="magicdec", draft="streamingllm", draft_budget=64, sink_tokens=4, gamma=3)
    return kwargs
