"""The training forward reuses the inference layers: same logits as the paged-cache path, and it learns."""

import torch

from model_workers.runner import ExtendItem, ModelRunner
from model_workers.training.recipe import Recipe, batch_losses
from model_workers.training.train_backend import TrainingBackend
from model_workers.training.trainer import ExpertBalancer, learning_rate
from support.tiny_models import tiny_training_model




def test_sparse_training_forward_equals_inference_path():
    model = tiny_training_model().eval()
    windows = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    backend = TrainingBackend(3, 20, sparse=True)
    with torch.no_grad():
        trained_view = model.logits(model(windows.reshape(-1), torch.arange(20).repeat(3), backend)).view(3, 20, -1)
    runner = ModelRunner(model, num_pages=8, page_size=8)
    for row, window in enumerate(windows.tolist()):
        (table,) = runner.standalone_tables([len(window)])
        with torch.no_grad():
            expected = model.logits(runner.extend([ExtendItem(table, window)]))
        torch.testing.assert_close(trained_view[row], expected, atol=1e-5, rtol=0)


def test_dense_training_forward_equals_sparse_when_topk_covers_the_context():
    model = tiny_training_model().eval()
    windows = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))  # 6 <= index_topk
    outputs = []
    for sparse in (False, True):
        with torch.no_grad():
            hidden = model(windows.reshape(-1), torch.arange(6).repeat(2), TrainingBackend(2, 6, sparse))
        outputs.append(model.logits(hidden))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)


def test_training_reduces_losses_and_indexer_kl_trains_only_the_indexer():
    torch.manual_seed(0)
    model = tiny_training_model(seed=3).train()
    pattern = torch.arange(23) % 7  # a periodic sequence every head can learn
    windows = torch.stack([pattern.roll(-k) for k in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    balancer = ExpertBalancer(model, rate=1e-3)
    first = None
    for step in range(30):
        losses = batch_losses(model, windows, sparse=step >= 10)
        if step == 0:
            first = losses
            model.zero_grad()
            losses.indexer_kl.backward(retain_graph=True)
            with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
            assert with_grad and all(".indexer." in n for n in with_grad)
        optimizer.zero_grad()
        losses.total(Recipe()).backward()
        optimizer.step()
        balancer.update()
    assert losses.lm < 0.5 * first.lm and losses.mtp < 0.5 * first.mtp
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and any(b.abs().sum() > 0 for b in biases)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    recipe = Recipe(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(recipe, 0, 100) == 0.1 and learning_rate(recipe, 9, 100) == 1.0
    assert abs(learning_rate(recipe, 100, 100) - 0.1) < 1e-9
