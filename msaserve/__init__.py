"""msaserve: serving platform for MSA long-context models."""
