"""`capture_graph` on the GPU: a capture keeps no autograd state, whatever the caller's
grad mode (the weights of a loaded model require grad; a stage's load runs with grad on)."""

import pytest
import torch

from omniflow.backends.cuda_graphs import capture_graph


@pytest.mark.gpu
def test_a_capture_with_grad_on_keeps_no_activations_for_a_backward_pass():
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    # 64 MiB an activation, 8 of them: far more than cuBLAS's workspaces on the new stream.
    static = torch.randn(16384, 1024, device="cuda")
    assert torch.is_grad_enabled() and layers[0].weight.requires_grad
    before = torch.cuda.memory_allocated()
    graph, out = capture_graph(lambda: layers(static), None, torch.cuda.Stream())
    held = torch.cuda.memory_allocated() - before
    assert not out.requires_grad
    assert held < 3 * static.nbytes, f"the graph holds {held / 2**20:.0f} MiB"
    static.copy_(torch.randn_like(static))
    graph.replay()
    with torch.no_grad():
        torch.testing.assert_close(out, layers(static), rtol=1e-3, atol=1e-3)
