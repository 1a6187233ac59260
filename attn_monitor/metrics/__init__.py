"""torchmetrics metrics of attention statistics and their summaries."""
