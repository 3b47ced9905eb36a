"""Task dpo: preference tuning (DPO and its relatives) on pairs of a chosen and a rejected reply (`task`), with
its losses in `loss`."""
