"""The page's tabs, one module each (its layout, its events, its API endpoint): One prompt, Batch, Audit; no tab imports
another."""
