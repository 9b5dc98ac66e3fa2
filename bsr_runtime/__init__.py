"""Protocol layer of BSR: tiers, probe, window plan, windowed retrieve, admission, commit."""
