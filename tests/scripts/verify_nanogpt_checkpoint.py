"""nanoGPT's training loop in miniature: a ``while True`` loop counting ``iter_num`` up to
``max_iters``, batches drawn by ``get_batch`` from the global torch RNG, and every
``eval_interval`` iterations a ``checkpoint = {'model': model.state_dict(), 'optimizer':
optimizer.state_dict(), ...}`` kept in a variable (its tensors are the live model's and
optimizer's). cfrun verify: exact (the variable comes back as aliases of the restored model
and optimizer, not as the values of the checkpoint it was restored from)."""

import torch
import torch.nn.functional as F

torch.manual_seed(1337)
vocab, block_size, batch_size = 16, 8, 4
data = torch.randint(0, vocab, (256,))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.ln(self.wte(idx)))


model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
iter_num = 0
best_val_loss = 1e9
eval_interval = 100
max_iters = 300
checkpoint = None
X, Y = get_batch()
while True:
    if iter_num % eval_interval == 0:
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
        }
    logits = model(X)
    loss = F.cross_entropy(logits.view(-1, vocab), Y.view(-1))
    X, Y = get_batch()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    best_val_loss = min(best_val_loss, loss.item())
    iter_num += 1
    if iter_num > max_iters:
        break
print("FINAL", best_val_loss)
