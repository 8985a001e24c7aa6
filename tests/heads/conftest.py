import pytest

from test_draft_heads import train


@pytest.fixture(scope="session")
def trained_heads(make_tiny_model, tiny_tokenizer):
    """trained_heads(architecture, method) -> Trainer after 40 steps (trained once per test run)."""
    cache = {}

    def get(architecture, method):
        if (architecture, method) not in cache:
            cache[architecture, method] = train(make_tiny_model(architecture), tiny_tokenizer, method, steps=40)
        return cache[architecture, method]

    return get
