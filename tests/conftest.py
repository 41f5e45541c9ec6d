"""Shared pytest setup. Service fixtures (redis-server, SeaweedFS) live in tests/services.py."""
from services import *  # noqa: F401,F403  (redis-server and SeaweedFS fixtures, tests/services.py)


import pytest  # noqa: E402
from models import HYBRID_WINDOW, save_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3 with 1 full-attention layer and 5 sliding ones (HYBRID_WINDOW tokens), as Gemma 3
    has (layer 0 full): tests/test_window_hits.py, tests/test_layer_groups.py."""
    return str(save_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("hybrid"), seed=4, num_hidden_layers=6,
                                    use_sliding_window=True, sliding_window=HYBRID_WINDOW, max_window_layers=1,
                                    layer_types=["full_attention"] + ["sliding_attention"] * 5))
