"""ROLL among its rivals: vanilla, ROLL, MMR, input-gradient regularization, IBP and
CROWN-IBP trained on MNIST, each tuned to two operating points, and measured side by
side with the same sound tools (`python -m examples.compare --quick`)."""
