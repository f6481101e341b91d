"""Training the recurrent drafter here: the target writes its own texts, and a head learns to predict them."""
