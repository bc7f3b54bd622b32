"""Rollout replicas: native engines in processes of their own (`hybridrl replica`, server.py), outside the
training ranks' process group, and the trainer-side client that uses them as one rollout engine
(`ReplicasEngine`, engine.py; `rollout.engine=replicas`). A replica that dies takes none of the training
ranks with it: its requests go to the other replicas, and a replacement joins at the next publication."""
