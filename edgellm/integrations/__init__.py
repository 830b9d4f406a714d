"""Optional integrations with other systems; each module needs its own extra (e.g. edgellm[ray])."""
