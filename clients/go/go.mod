module github.com/banyan-ai/banyan/clients/go

go 1.19
