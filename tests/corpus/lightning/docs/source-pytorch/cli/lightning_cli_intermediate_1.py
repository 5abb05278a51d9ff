# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/cli/lightning_cli_intermediate.rst
# at commit 7f0c3436cd3f6ad3753125672024fc415cbcb414: the `main.py` code block, unchanged and complete. The corpus
# runs it as the page does: `python main.py fit --model.out_dim 10 --model.learning_rate 0.1`.
# main.py
from lightning.pytorch.cli import LightningCLI

# simple demo classes for your convenience
from lightning.pytorch.demos.boring_classes import DemoModel, BoringDataModule


def cli_main():
    cli = LightningCLI(DemoModel, BoringDataModule)
    # note: don't call fit!!


if __name__ == "__main__":
    cli_main()
    # note: it is good practice to implement the CLI in a function and call it in the main if block
