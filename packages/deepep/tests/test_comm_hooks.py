"""DDP compression hooks: a small model trains to within 2% of the uncompressed loss."""

import pytest
import torch
from deepep.comm_hooks import Int8ErrorFeedbackState, TopKErrorFeedbackState

pytestmark = pytest.mark.timeout(150)


def test_ddp_hooks_match_uncompressed_loss(ranks):
    res = ranks(2, "ddp_training")
    for r in res:
        assert r == res[0]  # ranks agree (same averaged gradients)
    base = res[0]["base"]
    for name in ("int8", "topk"):
        assert abs(res[0][name] - base) <= 0.02 * base, (name, res[0])


def test_state_validation():
    with pytest.raises(ValueError, match="ratio"):
        TopKErrorFeedbackState(ratio=0.0)
    with pytest.raises(ValueError, match="block_size"):
        Int8ErrorFeedbackState(block_size=0)
    st = TopKErrorFeedbackState(ratio=0.2)
    st.residuals[0] = torch.ones(3)
    st.step = 4
    again = TopKErrorFeedbackState()
    again.load_state_dict(st.state_dict())
    assert again.ratio == 0.2 and again.step == 4 and torch.equal(again.residuals[0], torch.ones(3))
