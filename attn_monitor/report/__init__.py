"""What is done with a summary: logged names, logger adapters, pictures, alerts, comparison."""
