"""Fine-tune a tiny GPT-2 with Hugging Face ``transformers.Trainer`` (no downloads).

The model is built from a config in code (2 layers, 32-dim, random init) and trained on integer
tokens generated here (a repeating pattern with noise), with gradient accumulation. A plain
script that knows nothing about cfrun:

    python examples/hf_trainer_train.py --out hf.pt
    cfrun --interval 5 examples/hf_trainer_train.py --out hf.pt
"""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


class Tokens(Dataset):
    """``n`` sequences of ``length`` tokens: ``(start + 3 * i) % vocab`` with 10% noise."""

    def __init__(self, n, length, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        seq = (start + 3 * torch.arange(length)) % vocab
        noise = torch.rand(n, length, generator=g) < 0.1
        self.ids = torch.where(noise, torch.randint(0, vocab, (n, length), generator=g), seq)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--out", default="hf.pt")
    args = p.parse_args()

    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir="hf_out", per_device_train_batch_size=8, gradient_accumulation_steps=2,
        num_train_epochs=args.epochs, learning_rate=3e-3, logging_steps=4, save_strategy="no",
        report_to=[], seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=Tokens(args.samples, 16, 64, seed=1))
    result = trainer.train()
    torch.save(model.state_dict(), args.out)
    print(f"FINAL loss {result.training_loss:.6f} steps {result.global_step}")


if __name__ == "__main__":
    main()
